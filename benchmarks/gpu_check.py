"""Everything that needs a GPU, in one command of at most 8 minutes on one GPU:
the Triton kernel tests on CUDA (bit-exact against the CPU torch reference),
the kernel, rollout and syndrome codec benchmarks, and the smoke pipeline with
``resources.device=cuda``; then one JSON line with every figure.

    python benchmarks/gpu_check.py             # or: make gpu-check
    python benchmarks/gpu_check.py --dry-run   # or: make gpu-check DRY=1
    python benchmarks/gpu_check.py --only rollout smoke_pipeline   # a rerun of some steps after a fix

``--dry-run`` runs the same plan on the CPU (CUDA hidden) with the smallest
sizes and skips what needs CUDA, saying so, so that the plan is exercised on
any machine (tests/test_gpu_check.py). Each step runs in its own process under
its own time limit; the command exits non-zero if a step fails or runs out of
time. The limits are sized for a GPU machine (8 minutes together); a dry run
gives each ``DRY_TIME_FACTOR`` times as long, since its CPU, shared with other
work, runs the smoke pipeline far slower than a GPU (111 s of the GPU limit's
150 s at load average 5.5 on a 2-core machine).
"""

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tracefp4.components.device import cpu_kind, cuda_seen

ROOT = Path(__file__).resolve().parent.parent
GPU_BUDGET_S = 8 * 60  # the whole check on one GPU: the sum of the steps' limits
DRY_TIME_FACTOR = 2


@dataclass
class Step:
    """One part of the check: a command, its time limit, and what its output says."""

    name: str
    command: list[str]
    timeout_s: int  # on a GPU; a dry run allows DRY_TIME_FACTOR times as long
    dry_args: list[str] = field(default_factory=list)  # the smallest sizes, for a dry run
    needs_cuda: str | None = None  # why a dry run skips it


def plan(device: str, run_dir: Path) -> list[Step]:
    """The steps, at most ``GPU_BUDGET_S`` together (the sum of the time limits)."""
    py = sys.executable
    triton_tests = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_kernels.py"]
    syndrome_speed = [py, "benchmarks/guidance.py", "--parts", "speed", "--device", device]
    smoke_run = ["run", "--preset", "smoke", "--set", f"resources.device={device}", "--output", str(run_dir / "run")]
    smallest_rollout = [
        "--preset",
        "smoke",
        "--batches",
        "2",
        "--prompt-len",
        "8",
        "--new-tokens",
        "4",
        "--repeat",
        "1",
        "--linear-contexts",
        "8",
        "16",
        "--linear-batch",
        "2",
        "--linear-steps",
        "2",
        "--batching-rows",
        "2",
        "--batching-requests",
        "5",
        "--batching-new-tokens",
        "8",
    ]
    return [
        Step("triton_kernel_tests", triton_tests, 130, needs_cuda="the Triton kernels take CUDA tensors only"),
        # 16384^2 elements: at the default 4096^2 a GPU runs the kernels faster than Python launches them
        Step(
            "kernels",
            [py, "benchmarks/fp4_kernels.py", "--size", "16384"],
            55,
            dry_args=["--size", "256", "--repeat", "1"],
        ),
        # at issue #13's GPU target for the engine against generate: bf16, batches 32 and 128, 128 new tokens
        Step("rollout", [py, "benchmarks/rollout.py", "--new-tokens", "128"], 115, dry_args=smallest_rollout),
        Step("syndrome_codec", syndrome_speed, 45, dry_args=["--speed-rows", "256", "--repeat", "1"]),
        Step("smoke_pipeline", [py, "-m", "tracefp4.pipelines.cli", *smoke_run], 135),
    ]


def last_json(text: str) -> dict:
    """The last line of ``text`` that is a JSON object (a benchmark's figures)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def pipeline_figures(run_dir: Path) -> dict:
    """The smoke run's rollout and evaluation throughput, read from its outputs."""
    root = next((run_dir / "run" / "pipeline_root").iterdir())
    history = [json.loads(line) for line in (root / "train" / "history").read_text().splitlines()]
    results = json.loads((root / "evaluate" / "results").read_text())
    return {
        "rollout_tokens_per_second": history[0]["rollout_tokens_per_second"],
        **{f"eval_{row['rollout']}_tokens_per_second": row["tokens_per_second"] for row in results["throughput"]},
    }


def run_step(step: Step, dry: bool, env: dict, run_dir: Path) -> dict:
    if dry and step.needs_cuda:
        print(f"[{step.name}] skipped in the dry run: {step.needs_cuda}", flush=True)
        return {"status": "skipped", "reason": step.needs_cuda}
    command = step.command + (step.dry_args if dry else [])
    timeout_s = step.timeout_s * (DRY_TIME_FACTOR if dry else 1)
    print(f"[{step.name}] {' '.join(command)}", flush=True)
    start = time.perf_counter()
    # a session of its own, so that a step out of time is stopped with every process it started
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    with subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, **pipe) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
    out = {"status": "passed" if proc.returncode == 0 else "failed", "seconds": time.perf_counter() - start}
    print(output[-3000:] if proc.returncode else output.strip().rpartition("\n")[2][:500], flush=True)
    if proc.returncode == -signal.SIGKILL:
        out.update(status="timeout", timeout_s=timeout_s)
    elif proc.returncode == 0:
        if step.name == "triton_kernel_tests":
            out["summary"] = output.strip().splitlines()[-1]
        elif step.name == "smoke_pipeline":
            out["figures"] = pipeline_figures(run_dir)
        else:
            out["figures"] = last_json(output)
    return out


def stale_install(root: Path = ROOT) -> list[str]:
    """The checkout's modules that the importable tracefp4 does not hold as
    they are in ``root``. The tests and benchmarks run from the checkout, the
    library from wherever it is installed: a wheel built from an older commit
    (the offline install) would spend GPU time on old code."""
    stale = []
    for package, folder in package_folders(root).items():
        installed = Path(importlib.util.find_spec(package).submodule_search_locations[0])
        for source in sorted((root / folder).glob("*.py")):
            copy = installed / source.name
            if not copy.is_file() or copy.read_bytes() != source.read_bytes():
                stale.append(f"{folder}/{source.name}")
    return stale


def package_folders(root: Path = ROOT) -> dict[str, str]:
    """Each tracefp4 subpackage and the checkout folder it installs from, as pyproject.toml maps them."""
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="the same plan on the CPU, smallest sizes, CUDA steps skipped"
    )
    steps_help = ", ".join(step.name for step in plan("cpu", Path("run")))
    parser.add_argument(
        "--only", nargs="+", metavar="STEP", help=f"these steps alone, in the plan's order: {steps_help}"
    )
    args = parser.parse_args()
    stale = stale_install()
    if stale:
        print(
            f"the installed tracefp4 differs from this checkout in {', '.join(stale)} "
            "(reinstall it, or rebuild the offline wheels: make gpu-wheels)",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, even on a machine with a GPU
        device = "cpu"
    else:
        device = "cuda"
        if not torch.cuda.is_available():
            print(f"gpu-check needs a CUDA GPU: {cuda_seen()}; use --dry-run (make gpu-check DRY=1)", file=sys.stderr)
            return 2
        env.pop("TRITON_INTERPRET", None)  # real kernels, not the interpreter
    figures = {"mode": "dry-run" if args.dry_run else "cuda", "torch": torch.__version__, **cpu_kind()}
    if not args.dry_run:
        figures["gpu"] = torch.cuda.get_device_name(0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        planned = plan(device, Path(tmp))
        unknown = sorted(set(args.only or ()) - {step.name for step in planned})
        if unknown:
            parser.error(f"--only {' '.join(unknown)}: the plan's steps are {', '.join(s.name for s in planned)}")
        chosen = [step for step in planned if not args.only or step.name in args.only]
        steps = {step.name: run_step(step, args.dry_run, env, Path(tmp)) for step in chosen}
    figures.update(seconds=time.perf_counter() - start, steps=steps)
    print(json.dumps(figures))
    return 0 if all(s["status"] in ("passed", "skipped") for s in steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
