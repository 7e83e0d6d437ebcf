"""``resources.device`` reaches every step, a CUDA device the machine lacks
stops each step before any work, artifacts are CPU tensors; and bf16 matmuls
on a CPU without bf16 units run in fp32 with bf16 values."""

import json
import os
import subprocess
import sys

import pydantic
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from tracefp4.components import device, evaluation, steps
from tracefp4.components.checkpoint import provenance
from tracefp4.components.deltanet import causal_conv
from tracefp4.components.guidance import GuidanceRef
from tracefp4.components.model import attention, build_model
from tracefp4.components.quant_config import QuantConfig
from tracefp4.components.trainer import TrainConfig, Trainer
from tracefp4.components.trainer_state import TENSORS
from tracefp4.schemas import RunConfig, get_preset

RUN = "run-d"
RUN_QUIETLY = {"capture_output": True, "text": True, "check": True, "timeout": 300}
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")


def smoke(tmp_path, device_spec: str) -> RunConfig:
    data = get_preset("smoke").model_dump()
    data["bootstrap"]["enabled"] = False
    data["resources"]["device"] = device_spec
    data["store"]["uri"] = (tmp_path / "store").as_uri()
    return RunConfig.model_validate(data)


def test_the_schema_takes_device_names_only(tmp_path):
    for spec in ("auto", "cpu", "cuda", "cuda:3"):  # validation never asks the machine: it may not be the one that runs
        assert smoke(tmp_path, spec).resources.device == spec
    for spec in ("gpu", "cuda:", "CUDA", "cuda:0:1", "mps"):
        with pytest.raises(pydantic.ValidationError, match="device"):
            smoke(tmp_path, spec)
    assert get_preset("smoke").resources.device == "auto"


def test_a_cluster_step_on_a_device_past_its_one_gpu_is_refused(tmp_path):
    """On a cluster a step's pod is given one GPU, which it sees as cuda:0 (a
    training node's pod gets resources.gpus, its ranks on cuda:LOCAL_RANK)."""
    data = smoke(tmp_path, "cuda:1").model_dump()
    data["resources"].update(gpus=4, accelerator_type="nvidia.com/gpu")
    with pytest.raises(pydantic.ValidationError, match="resources.device: cuda:1, but a step's pod is given one GPU"):
        RunConfig.model_validate(data)
    data["resources"]["device"] = "cuda:0"
    RunConfig.model_validate(data)


def test_resolve():
    assert device.resolve("cpu") == torch.device("cpu")
    auto = device.resolve("auto")
    assert auto == (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )
    with pytest.raises(ValueError, match="resources.device"):
        device.resolve("tpu")


def test_a_step_on_cuda_makes_its_indexed_device_current(monkeypatch, tmp_path):
    """``cuda`` and ``auto`` resolve to the current CUDA device with its index:
    torch.cuda.set_device (which every step calls) refuses one without. CUDA
    is faked down to the driver call, so that set_device's own check runs."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", current.append, raising=False)
    for spec, index in (("cuda", 1), ("auto", 1), ("cuda:0", 0)):
        assert device.resolve(spec) == torch.device("cuda", index)
        assert steps.step_device(smoke(tmp_path, spec)) == torch.device("cuda", index)
    assert current == [1, 1, 0]


@needs_no_gpu
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_names_the_setting_and_what_torch_sees(spec):
    with pytest.raises(RuntimeError, match=rf"resources.device is '{spec}', but .*(without CUDA|no CUDA device)"):
        device.resolve(spec)


@needs_no_gpu
def test_every_step_fails_on_a_missing_gpu_before_any_work(tmp_path):
    """Every input path is missing: a step that did any work first (reading its
    policy, trajectories or store) would fail on that instead."""
    config = smoke(tmp_path, "cuda")
    missing = tmp_path / "missing"
    ref = GuidanceRef(RUN, 0, 0, QuantConfig(), {})
    calls = {
        "prepare": lambda: steps.prepare(config, tmp_path / "out", RUN, tmp_path / "state"),
        "rollout": lambda: steps.rollout(config, missing, 0, tmp_path / "t.jsonl", RUN),
        "compaction": lambda: steps.compaction(config, missing, missing, 0, RUN),
        "train": lambda: steps.train(config, missing, missing, missing, ref, tmp_path / "out", tmp_path / "s", RUN),
        "run_round": lambda: steps.run_round(
            config, missing, missing, 0, tmp_path / "out", tmp_path / "s", tmp_path, RUN
        ),
        "evaluate": lambda: evaluation.evaluate(config, missing, missing),
    }
    for call in calls.values():
        with pytest.raises(RuntimeError, match="resources.device is 'cuda'"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, no store created


def test_prepare_without_a_bootstrap_leaves_the_step_device_alone(tmp_path, monkeypatch):
    """It only checks the policy and writes it with a fresh trainer state: in host memory, where a paper-scale
    checkpoint with its float32 copy fits (the device is still resolved first: a missing GPU fails the step)."""
    data = smoke(tmp_path, "cpu").model_dump()
    data["bootstrap"]["enabled"] = False
    monkeypatch.setattr(steps, "step_device", lambda config: torch.device("meta"))  # where nothing can be written
    steps.prepare(RunConfig.model_validate(data), tmp_path / "p0", RUN, tmp_path / "s0")
    assert provenance(tmp_path / "p0")["policy_version"] == 0 and (tmp_path / "s0" / TENSORS).exists()


def test_a_round_on_the_cpu_writes_device_independent_artifacts(tmp_path):
    config = smoke(tmp_path, "cpu")
    steps.prepare(config, tmp_path / "p0", RUN, tmp_path / "s0")
    history = steps.run_round(
        config, tmp_path / "p0", tmp_path / "s0", 0, tmp_path / "p1", tmp_path / "s1", tmp_path, RUN
    )
    assert history[0]["step"] == 1 and provenance(tmp_path / "p1")["policy_version"] == 1
    # each row says where its round rolled out and it trained: in a cluster, nodes of their own
    cpu = device.hardware(torch.device("cpu"))
    where = {"device": device.hardware_words(cpu), "cpu_bf16": cpu["cpu_bf16"]}
    assert where == device.measured_on(torch.device("cpu")) and where["device"].startswith("cpu (")
    assert all(row[f"{step}_{k}"] == v for row in history for step in ("rollout", "train") for k, v in where.items())
    with safe_open(tmp_path / "s1" / TENSORS, framework="pt") as f:
        assert f.keys() and all(f.get_tensor(k).device.type == "cpu" for k in f.keys())
    header = json.loads((tmp_path / "trajectories-0.jsonl").read_text().splitlines()[0])["header"]
    assert header["global_scales"] and all(isinstance(g, float) for g in header["global_scales"].values())
    trainer = Trainer.from_checkpoint(tmp_path / "p1", tmp_path / "s1", TrainConfig(), QuantConfig(), {}, "cpu", RUN)
    assert {t.device for s in trainer.optimizer.state.values() for t in s.values()} == {torch.device("cpu")}
    result = evaluation.evaluate(config, tmp_path / "p1")
    assert {row["rollout"] for row in result["accuracy"]} == set(config.evaluation.rollout_configs)


# -- bf16 on a CPU without bf16 units ------------------------------------------

AVX2_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""
SAPPHIRE_RAPIDS = (
    "model name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
)
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd40\n"


@pytest.fixture
def onednn_cap(monkeypatch):
    """Sets (or with None, clears) a oneDNN ISA cap variable, the other name cleared; the cap is read once
    per process, so the cache goes too, before and after the test."""

    def cap(value: str | None, name: str = "ONEDNN_MAX_CPU_ISA") -> None:
        for variable in device.ONEDNN_ISA_ENV:
            monkeypatch.delenv(variable, raising=False)
        if value is not None:
            monkeypatch.setenv(name, value)
        device.onednn_isa_cap.cache_clear()

    cap(None)
    yield cap
    monkeypatch.undo()
    device.onednn_isa_cap.cache_clear()


@pytest.fixture
def torch_bf16(monkeypatch):
    """Sets what torch says of its oneDNN's bf16 (:func:`device.onednn_bf16`), True unless told: the
    cpuinfo texts below stand for other machines than the one the tests run on."""

    def says(supported: bool) -> None:
        monkeypatch.setattr(device, "onednn_bf16", lambda: supported)

    says(True)
    return says


@pytest.fixture
def cpuinfo(monkeypatch, tmp_path):
    """Sets this machine's ``/proc/cpuinfo`` text (None: no such file, as on macOS); read once per process,
    so the cache goes too, before and after the test."""

    def text(content: str | None) -> None:
        path = tmp_path / "cpuinfo"
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        monkeypatch.setattr(device, "CPUINFO", path)
        device.cpu_info.cache_clear()

    yield text
    monkeypatch.undo()
    device.cpu_info.cache_clear()


@pytest.mark.parametrize("torch_says", [True, False])
@pytest.mark.parametrize("text", [SAPPHIRE_RAPIDS, AVX2_EPYC, None], ids=["bf16 units", "none", "no cpuinfo"])
def test_native_bf16_takes_torch_and_the_cpu_both(text, torch_says, cpuinfo, torch_bf16, onednn_cap, monkeypatch):
    """Native only where torch runs bf16 in oneDNN and the CPU has bf16 units; without /proc/cpuinfo (not
    Linux) torch's answer alone: before, a missing file or a torch without oneDNN's bf16 counted as native,
    and ``auto`` left bf16 matmuls to kernels that crawl (and sum a row by its batch)."""
    monkeypatch.setenv(device.CPU_BF16_ENV, "auto")
    cpuinfo(text)
    torch_bf16(torch_says)
    native = torch_says and text != AVX2_EPYC
    assert device.cpu_bf16_native() == native and device.bf16_emulated() == (not native)
    assert device.cpu_kind()["cpu_bf16"] == ("native" if native else "emulated")
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # torch's bf16 matmuls then leave oneDNN
    assert not device.cpu_bf16_native()


def test_torch_answers_whether_its_onednn_takes_bf16():
    assert isinstance(device.onednn_bf16(), bool)
    assert device.onednn_bf16() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_cpuinfo_tells_native_bf16(onednn_cap, torch_bf16):
    model, flags = device.parse_cpuinfo(AVX2_EPYC)
    assert model == "AMD EPYC 7B13" and not device.cpu_bf16_native(flags)
    assert device.cpu_bf16_native(device.parse_cpuinfo(SAPPHIRE_RAPIDS)[1])
    assert device.cpu_bf16_native(device.parse_cpuinfo(GRAVITON3)[1])


@pytest.mark.parametrize(
    "cap, native",
    [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_VNNI", False), ("AVX512_CORE_BF16", True), ("ALL", True)],
)
def test_onednn_capped_below_bf16_is_a_cpu_without_it(cap, native, onednn_cap, torch_bf16):
    """oneDNN runs torch's bf16 matmuls on x86: capped below AVX512_CORE_BF16
    it leaves the bf16 units unused, so ``auto`` emulates as on a CPU without them."""
    sapphire_rapids = device.parse_cpuinfo(SAPPHIRE_RAPIDS)[1]
    onednn_cap(cap)
    assert device.onednn_isa_cap() == cap.upper()
    assert device.cpu_bf16_native(sapphire_rapids) == native
    assert device.cpu_kind()["cpu_onednn_isa_cap"] == cap.upper()
    assert not device.cpu_bf16_native(device.parse_cpuinfo(AVX2_EPYC)[1])  # no cap gives bf16 units
    onednn_cap(cap, "DNNL_MAX_CPU_ISA")  # the variable's older name
    assert device.cpu_bf16_native(sapphire_rapids) == native
    onednn_cap(None)
    assert device.onednn_isa_cap() is None and device.cpu_bf16_native(sapphire_rapids)


def test_the_env_variable_forces_the_mode(monkeypatch):
    seen = []

    def matmul(a, b):  # records the dtype the matmul computes in
        seen.append(a.dtype)
        return a @ b

    a, b = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16)
    monkeypatch.setenv(device.CPU_BF16_ENV, "emulate")
    assert device.bf16_emulated() and device.cpu_kind()["cpu_bf16"] == "emulated"
    assert device.batch_invariant(matmul, a, b).dtype == torch.bfloat16 and seen.pop() == torch.float32
    device.batch_invariant(matmul, a.float(), b.float())  # float32 stays float32, untouched
    assert seen.pop() == torch.float32
    monkeypatch.setenv(device.CPU_BF16_ENV, "native")
    assert not device.bf16_emulated() and device.cpu_kind()["cpu_bf16"] == "native"
    assert device.batch_invariant(matmul, a, b).dtype == torch.bfloat16 and seen.pop() == torch.bfloat16
    monkeypatch.setenv(device.CPU_BF16_ENV, "auto")
    assert device.bf16_emulated() == (not device.cpu_bf16_native())
    monkeypatch.setenv(device.CPU_BF16_ENV, "fast")
    with pytest.raises(ValueError, match="TRACEFP4_CPU_BF16"):
        device.bf16_emulated()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


MATMULS = [
    (F.linear, [(37, 96), (80, 96), (80,)]),
    (torch.bmm, [(4, 19, 64), (4, 64, 48)]),
    (torch.matmul, [(3, 2, 40, 32), (3, 2, 32, 5)]),
]


@pytest.mark.parametrize("op, shapes", MATMULS)
def test_emulated_bf16_matmul_is_a_bf16_matmul_up_to_accumulation_order(op, shapes, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    monkeypatch.setenv(device.CPU_BF16_ENV, "native")
    native = device.batch_invariant(op, *args)
    monkeypatch.setenv(device.CPU_BF16_ENV, "emulate")
    emulated = device.batch_invariant(op, *args)
    assert emulated.dtype == torch.bfloat16 and torch.equal(emulated, op(*(a.float() for a in args)).bfloat16())
    same_sign = native.sign() == emulated.sign()
    assert same_sign.float().mean() > 0.99 and _ulps(native[same_sign], emulated[same_sign]).max() <= 1


ROW_COUNT_MATMULS = [  # inner sizes 64 to 2048, 1 to 1024 outputs, as measured (device.SMALL_GEMM_ROWS)
    (F.linear, [(300, 64), (1024, 64)]),
    (F.linear, [(300, 64), (1, 64)]),  # one output: the shared expert's gate
    (F.linear, [(300, 2048), (1, 2048)]),
    (F.linear, [(300, 256), (96, 256)]),
    (F.linear, [(300, 2048), (8, 2048)]),
    (torch.bmm, [(4, 60, 512), (4, 512, 64)]),
    (torch.bmm, [(4, 60, 2048), (4, 2048, 256)]),
]


@pytest.mark.parametrize("op, shapes", ROW_COUNT_MATMULS)
def test_a_float32_matmuls_rows_do_not_depend_on_its_row_count(op, shapes):
    """A request's bits must not depend on what shares its batch, so where
    the CPU computes in float32 (a float32 model; bf16 where it is emulated)
    neither may a matmul's rows on how many rows it multiplies. MKL sums the
    rows of a linear of fewer than 12 rows past the last whole block of 4 (at
    1-3, 5-7 and 9-11 rows), and those of a bmm of fewer than 4, in another
    order than a larger matmul does, and a linear of one output at most row
    counts from 13 on: such matmuls run padded to whole blocks, and a linear
    of one output as one of two (this test failed without each)."""
    gen = torch.Generator().manual_seed(3)
    x, w = (torch.randn(s, generator=gen).bfloat16().float() for s in shapes)
    full = device.batch_invariant(op, x, w)
    for n in range(1, 20):
        rows = device.batch_invariant(op, x.narrow(-2, 0, n), w)
        assert torch.equal(rows, full.narrow(-2, 0, n)), n


MKL_MODE_AFTER_IMPORTS = """
import ctypes, os, sys, torch
mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
if not hasattr(mkl, "mkl_serv_cbwr_get"):
    sys.exit("no MKL")
import tracefp4.pipelines.cli, tracefp4.components.steps  # everything the steps and the command import
torch.randn(8, 8) @ torch.randn(8, 8)  # MKL's first call reads MKL_CBWR
print(hex(mkl.mkl_serv_cbwr_get(-1)))  # MKL_CBWR_ALL: the branch, and the strict flag (0x10000)
"""


def test_mkl_computes_in_its_strict_mode_once_the_library_is_imported():
    """MKL reads ``MKL_CBWR`` at its first call: importing the library sets it
    (``device.MKL_MODE``) and computes nothing first, so a step's process, or
    one that imports the library before its own math, runs MKL in strict mode
    (AUTO branch), where a float32 row's bits do not move with its matmul's
    row count on an Intel Xeon either; a mode the environment names stays."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    command, quietly = [sys.executable, "-P", "-c", MKL_MODE_AFTER_IMPORTS], {**RUN_QUIETLY, "check": False}
    run = subprocess.run(command, env=env, **quietly)
    if run.returncode and "no MKL" in run.stderr:
        pytest.skip("this torch has no MKL")
    assert run.returncode == 0 and run.stdout.strip() == "0x10002", run.stderr[-2000:]  # MKL_CBWR_AUTO | STRICT
    env["MKL_CBWR"] = "COMPATIBLE"
    run = subprocess.run(command, env=env, **quietly)
    assert run.stdout.strip() == "0x3", run.stderr[-2000:]  # MKL_CBWR_COMPATIBLE


@pytest.mark.parametrize("inner, outputs", [(32, 32), (64, 64), (128, 8), (256, 8)])
def test_a_small_bf16_linears_rows_do_not_depend_on_its_row_count(monkeypatch, inner, outputs):
    """torch's native bf16 linear of up to 16^3 multiply-adds runs on its own
    kernel, a larger one on oneDNN's, and they sum in other orders: the small
    layers of the test models (a 64 x 64 output projection, a 256 x 8 router)
    gave a row other bits alone than beside others (this test failed at 1-4
    rows). Padded past that size, every row count takes oneDNN's."""
    monkeypatch.setenv(device.CPU_BF16_ENV, "native")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2048, inner, generator=gen).bfloat16()
    w = (0.02 * torch.randn(outputs, inner, generator=gen)).bfloat16()
    full = device.batch_invariant(F.linear, x, w)
    for n in (1, 2, 3, 4, 5):  # the kernels differ in a few rows in a thousand: every row, n at a time
        rows = torch.cat([device.batch_invariant(F.linear, x[i : i + n], w) for i in range(0, 2045, n)])
        assert torch.equal(rows, full[: len(rows)]), n
    assert device.batch_invariant(F.linear, x[:1, None], w).shape == (1, 1, outputs)  # leading dims kept


@pytest.mark.parametrize("heads, kv_heads, head_dim, span", [(4, 2, 32, 128), (2, 2, 128, 224)])
def test_a_float32_attention_querys_bits_do_not_depend_on_the_query_count(heads, kv_heads, head_dim, span):
    """A prefill's query count is the longest prompt beside a request's. SDPA's
    float32 kernel multiplies blocks of 32 queries, and the queries of a last
    block of 1-3 summed in another order (at 2-3, 33-35, 65-67, ... queries):
    queries run padded to whole blocks of 4 (this test failed without)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, heads, span, head_dim, generator=gen)
    k, v = (torch.randn(2, kv_heads, span, head_dim, generator=gen) for _ in range(2))
    visible = torch.ones(span, span, dtype=torch.bool).tril()[None, None]  # the prefill's causal mask
    full = attention(q, k, v, visible)
    for n in range(1, 70):
        assert torch.equal(attention(q[:, :, :n], k, v, visible[:, :, :n]), full[:, :, :n]), n


def test_emulated_attention_is_fp32_attention_of_the_bf16_operands(monkeypatch):
    """The model's one attention (training, the rollout's prefill and decode)
    emulated: SDPA in fp32 on the bf16 operands, rounded once. Native bf16 SDPA
    also rounds its softmax weights to bf16, so the two differ by more than
    accumulation order, though little."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(s, generator=gen).bfloat16() for s in [(3, 4, 6, 32), (3, 2, 40, 32), (3, 2, 40, 32)])
    mask = (torch.arange(40) < torch.tensor([40, 17, 33])[:, None])[:, None, None]  # [B, 1, 1, L]
    monkeypatch.setenv(device.CPU_BF16_ENV, "emulate")
    emulated = attention(q, k, v, mask)
    fp32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    assert emulated.dtype == torch.bfloat16 and torch.equal(emulated, fp32.bfloat16())
    monkeypatch.setenv(device.CPU_BF16_ENV, "native")
    native = attention(q, k, v, mask)
    assert native.dtype == torch.bfloat16 and (native.float() - emulated.float()).abs().max() < 1 / 64


def test_emulation_under_autocast_rounds_operands_as_autocast_does(monkeypatch):
    """Training's BF16 autocast over float32 master weights: the same values as autocast's bf16 linear."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(33, 64, generator=gen, requires_grad=True), torch.randn(48, 64, generator=gen)
    monkeypatch.setenv(device.CPU_BF16_ENV, "emulate")
    with torch.autocast("cpu", torch.bfloat16):
        emulated = device.batch_invariant(F.linear, x, w)
        native = F.linear(x, w)
    assert emulated.dtype == native.dtype == torch.bfloat16
    assert torch.equal(emulated, F.linear(x.bfloat16().float(), w.bfloat16().float()).bfloat16())
    assert _ulps(native, emulated).max() <= 1
    emulated.float().sum().backward()  # gradients still reach the float32 input
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_a_bf16_model_forward_emulated_matches_native(monkeypatch):
    model = build_model("smoke", seed=0, dtype=torch.bfloat16)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, 12)
    logits = {}
    for mode in ("native", "emulate"):
        monkeypatch.setenv(device.CPU_BF16_ENV, mode)
        with torch.no_grad():
            logits[mode] = model(tokens, positions).float()
    assert torch.allclose(logits["native"], logits["emulate"], atol=0.02, rtol=0.02)
    assert logits["native"].argmax(-1).eq(logits["emulate"].argmax(-1)).float().mean() > 0.9


# the aten ops that multiply and sum along an inner dimension: where bf16 is emulated none may see a bf16 operand
# (torch's bf16 kernels of them are the ones that crawl on a CPU without bf16 units)
MATMUL_OPS = (
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_grouped_mm", "convolution",
    "convolution_backward", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_attention_math",
)  # fmt: skip


class _Bf16Matmuls(TorchDispatchMode):
    """The matmul-like aten ops (:data:`MATMUL_OPS`) called with a bf16 tensor, forward and backward."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.overloadpacket.__name__ in MATMUL_OPS and any(t.dtype == torch.bfloat16 for t in tensors):
            self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("preset", ["tiny-qwen35", "tiny-qwen2"])
@pytest.mark.parametrize("precision", ["bf16", "fp32_master"])
def test_where_bf16_is_emulated_no_matmul_conv_or_attention_computes_in_bf16(monkeypatch, preset, precision):
    """A bf16 model's forward and backward (``bf16``; ``fp32_master``'s bf16
    autocast alike): the linear layers, the experts' ``bmm``, attention, the
    LM head and Gated DeltaNet's depthwise conv all run in fp32 where bf16 is
    emulated; and the conv's values are those of torch's bf16 conv. The
    conv had escaped: on the AVX2 stand-in (``make test-avx2``) torch's bf16
    depthwise conv took 20-70x as long as fp32's, 0.7 s per layer for a
    decode step of Qwen3.5-35B-A3B's 8,192 channels at batch 16."""
    model = build_model(preset, seed=0, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, 12)
    monkeypatch.setenv(device.CPU_BF16_ENV, "emulate")
    watch = _Bf16Matmuls()
    with watch:
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "fp32_master"):  # the trainer's
            logits = model(tokens, positions)
        logits.float().sum().backward()
    assert not watch.seen
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    weight, history = (torch.randn(64, 4) * 0.3).bfloat16(), torch.randn(3, 64, 3).bfloat16()
    emulated = causal_conv(x, weight, history)
    monkeypatch.setenv(device.CPU_BF16_ENV, "native")
    assert torch.equal(emulated, causal_conv(x, weight, history))


@pytest.mark.parametrize("fn", [F.softplus, torch.sigmoid])
def test_size_independent_gives_an_element_the_same_bits_whatever_the_tensor_size(fn):
    """Each of 4,096 float32 inputs alone (a scalar loop's element) against in
    one tensor (the vector loop's): the plain kernel differs in some, as this
    is what the helper is for; ``size_independent`` in none, also at bf16."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3

    def alone_and_together(f, t):
        return torch.cat([f(t[i : i + 1]) for i in range(len(t))]), f(t)

    alone, together = alone_and_together(fn, x)
    assert not torch.equal(alone, together), "the CPU's vector and scalar loops agree here: nothing to guard"
    for dtype in (torch.float32, torch.bfloat16):
        alone, together = alone_and_together(lambda t: device.size_independent(fn, t), x.to(dtype))
        assert together.dtype == dtype and torch.equal(alone, together), dtype
        plain = fn(x.to(dtype))  # the same function: within a few units in the last place
        assert torch.allclose(together, plain, rtol=4 * torch.finfo(dtype).eps, atol=0), dtype


FAULTS_OF_ROLLOUTS = """
import resource, torch
from tracefp4.components import device, steps
from tracefp4.components.model import build_model
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.schemas import RunConfig
assert steps.step_device(RunConfig.model_validate_json(input())).type == "cpu"
engine = TorchEngine(build_model("tiny", seed=0))
prompts = torch.randint(0, 512, (128, 32), generator=torch.Generator().manual_seed(0)).tolist()
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.generate(prompts, SamplingParams(max_new_tokens=64))
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_a_cpu_step_process_keeps_freed_memory_instead_of_faulting_it_in_again(tmp_path):
    """Rollouts of the benchmark's batch (128 x 32 + 64 tokens) in a fresh CPU
    step process: after the first two calls, next to no page faults (0-2,549
    seen here, alone or beside a busy process). Without keep_freed_memory glibc
    handed the memory of tensors of a few hundred KB back to the kernel, and
    every later call faulted 14,000 to 41,000 pages in again. One call in a
    clean clone's CI, with another test file running beside it, faulted 6,153
    (the calls on either side 29 and 4; what faulted them was not pinned
    down), so one later call in four may miss."""
    config = smoke(tmp_path, "cpu").model_dump_json()
    run = subprocess.run([sys.executable, "-c", FAULTS_OF_ROLLOUTS], input=config, **RUN_QUIETLY)
    faults = [int(line) for line in run.stdout.split()]
    assert len(faults) == 6 and sum(later < 5000 for later in faults[2:]) >= 3, faults
