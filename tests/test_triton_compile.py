"""Every Triton kernel compiles for the GPUs users run, without one.

The bit-exact tests (test_triton_kernels.py) run the kernels in Triton's
interpreter, which executes their Python and never runs the compiler. The
compiler rejects code the interpreter runs: two such bugs passed every
interpreted test and would have failed every CUDA launch of those kernels (a
helper returning inside a constexpr branch and again after it, which the
compiler types as one function with two return types; a kernel reading a
module global that is not a ``tl.constexpr``).

So here each kernel is compiled ahead of time, by Triton's compiler and the
``ptxas`` its wheel ships, to a cubin for sm_90 (H100, H200) and sm_100
(B200), in every specialization its launchers produce over the formats, scale
modes, global scales (none, one, one per row), guidance bits, packed bit
widths and codec sizes. The interpreter is chosen when triton is imported, so
the compiling runs in a process of its own: this file run as a script, where
each kernel is replaced by a stand-in whose launch compiles instead of running
(the launchers' outputs are then never read).
"""

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch
from test_triton_kernels import MODES

from tracefp4.kernels import GUIDANCE_BITS, HAS_TRITON

ARCHS = (90, 100)  # H100 and H200; B200
SHARED_MEMORY_PER_BLOCK = 227 * 1024  # both archs' most; a kernel over it compiles, then fails every launch
# (block length n, parity rows, erasures): the smallest and widest blocks a program holds, the scale stage's
# (MXFP4's 8 scales and NVFP4's 16 at their own bits, all unknown), and tiers in between
CODEC_SIZES = [(8, 8, 8), (16, 8, 0), (16, 16, 16), (96, 40, 30), (256, 64, 56), (600, 32, 24), (4096, 64, 62)]


@dataclass
class Compiles:
    """What compiling for ``archs`` came to. :meth:`compile` compiles the
    specialization a launch's arguments make, for every arch, and records a
    failure instead of raising, so that one run reports all."""

    archs: tuple = ARCHS
    launched: set = field(default_factory=set)
    tried: set = field(default_factory=set)
    compiled: set = field(default_factory=set)
    failed: list = field(default_factory=list)
    most_shared_memory: int = 0

    def compile(self, kernel, *args, **constexprs):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import mangle_type

        self.launched.add(kernel.__name__)
        names = kernel.arg_names
        types = iter(mangle_type(a) for a in args)
        signature = {name: "constexpr" if name in constexprs else next(types) for name in names}
        values = {(names.index(name),): value for name, value in constexprs.items()}
        for arch in self.archs:
            key = json.dumps([kernel.__name__, arch, signature, constexprs], sort_keys=True)
            if key in self.tried:
                continue
            self.tried.add(key)
            try:
                binary = triton.compile(ASTSource(kernel, signature, values), target=GPUTarget("cuda", arch, 32))
                if binary.metadata.shared > SHARED_MEMORY_PER_BLOCK:
                    raise RuntimeError(f"{binary.metadata.shared} bytes of shared memory")
                self.compiled.add(kernel.__name__)
                self.most_shared_memory = max(self.most_shared_memory, binary.metadata.shared)
            except Exception as e:  # noqa: BLE001 (every failure is reported, and fails the test)
                while e.__cause__ is not None:  # a CompilationError points at the call; its cause says what is wrong
                    e = e.__cause__
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                self.failed.append(f"sm_{arch} {kernel.__name__} {constexprs}: {reason}")


class CompileOnly:
    """A kernel's stand-in: ``kernel[grid](*args, **constexprs)`` compiles instead of running."""

    def __init__(self, kernel, compiles: Compiles):
        self.launch = functools.partial(compiles.compile, kernel)

    def __getitem__(self, grid):
        return self.launch


def launch_every_specialization() -> None:
    """Each launcher over every choice that changes a kernel's compile-time
    flags or argument types, on CPU tensors (only their dtypes matter)."""
    from tracefp4.kernels import triton_kernels as tk
    from tracefp4.kernels import triton_syndrome as ts
    from tracefp4.kernels.syndrome import parity_matrix

    x = torch.randn(4, 64)
    for fmt, mode in MODES:
        globals_ = [None] if not fmt.has_global_scale else [None, torch.tensor(0.01), torch.full((4,), 0.01)]
        for g in globals_:
            for typed in (x, x.bfloat16()):
                codes, scales, g_out = tk.quantize(typed, fmt, g, mode)
                tk.fake_quantize(typed, fmt, g, mode)
                guidance = torch.zeros(x.shape, dtype=torch.uint8)
                for bits in GUIDANCE_BITS:
                    tk.quantize_guided(typed, fmt, scales, g_out, guidance, bits)
                    tk.fake_quantize_guided(typed, fmt, scales, g_out, guidance, bits)
            tk.dequantize(codes, fmt, scales, g_out)
    for bits in GUIDANCE_BITS:
        tk.expand_codes(tk.compact_codes(torch.zeros(4, 64, dtype=torch.uint8), bits), bits, 64)
    for n, rows, erasures in CODEC_SIZES:
        guess = torch.zeros(8, n, dtype=torch.uint8)
        parity = torch.zeros(8, rows, dtype=torch.uint8)
        ts.solve_erasures(guess, torch.rand(8, n), parity, parity_matrix(rows, n, 1), erasures)


def compile_all(archs: tuple) -> dict:
    """Compile every kernel's specializations for ``archs``; the report names
    the kernels compiled, those never launched, and every failure."""
    import triton

    from tracefp4.kernels import triton_kernels, triton_syndrome

    compiles = Compiles(archs)
    kernels = []
    for module in (triton_kernels, triton_syndrome):
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(module, name, CompileOnly(value, compiles))
                kernels.append(name)
    launch_every_specialization()
    return {
        "triton": triton.__version__,
        "archs": [f"sm_{a}" for a in archs],
        "compiles": len(compiles.tried),
        "most_shared_memory_bytes": compiles.most_shared_memory,
        "kernels": sorted(compiles.compiled),
        "never_launched": sorted(set(kernels) - compiles.launched),
        "failed": compiles.failed,
    }


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed on this platform")
def test_every_kernel_compiles_for_sm90_and_sm100(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not read from an earlier run's cache
    # one process per arch, side by side: the compiler and ptxas run on one core each
    runs = [
        subprocess.Popen([sys.executable, __file__, str(arch)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for arch in ARCHS
    ]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=900)
        assert run.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out.decode().splitlines()[-1]))
    for result in results:
        assert not result["failed"], "\n".join(result["failed"])
        assert not result["never_launched"], f"kernels no launcher reached here: {result['never_launched']}"
        assert {"_fp4_block_kernel", "_dequantize_kernel", "_solve_kernel", "_syndrome_kernel"} <= set(
            result["kernels"]
        )
    assert [r["archs"] for r in results] == [[f"sm_{a}"] for a in ARCHS]
    assert sum(r["compiles"] for r in results) > 100  # every flag combination above, for both archs


def test_the_stand_in_reports_what_the_compiler_rejects(tmp_path):
    """The check can fail: a kernel with the helper bug described above is reported, not compiled."""
    pytest.importorskip("triton")
    script = tmp_path / "bad_kernel.py"
    script.write_text(
        "import json, sys, triton, triton.language as tl\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_triton_compile import CompileOnly, Compiles\n"
        "@triton.jit\n"
        "def _pick(p, ROW: tl.constexpr):\n"
        "    if ROW:\n"
        "        return tl.load(p + tl.arange(0, 8))\n"
        "    return tl.load(p)\n"
        "@triton.jit\n"
        "def _bad_kernel(p, out, ROW: tl.constexpr):\n"
        "    tl.store(out + tl.arange(0, 8), _pick(p, ROW))\n"
        "compiles = Compiles()\n"
        "import torch\n"
        "CompileOnly(_bad_kernel, compiles)[(1,)](torch.zeros(8), torch.zeros(8), ROW=True)\n"
        "print(json.dumps(compiles.failed))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.splitlines()[-1])
    assert len(failed) == len(ARCHS) and all("_bad_kernel" in f and "return types" in f for f in failed)


if __name__ == "__main__":
    result = compile_all(tuple(int(arch) for arch in sys.argv[1:]) or ARCHS)
    print(json.dumps(result))
    sys.exit(1 if result["failed"] or result["never_launched"] else 0)
