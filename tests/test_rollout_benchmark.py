"""`benchmarks/rollout.py --speed-only` runs in the tests at the smallest
sizes, so that the command behind the engine-against-generate figures
(docs/performance.md, both CPU kinds) cannot rot; the full benchmark runs in
the GPU check's dry run (tests/test_gpu_check.py)."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from tracefp4.components import model as model_module
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rollout import TorchEngine

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("rollout_benchmark", ROOT / "benchmarks" / "rollout.py")
rollout_benchmark = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rollout_benchmark)


def test_speed_only_ends_with_the_engine_against_generate_alone():
    command = [sys.executable, "benchmarks/rollout.py", "--speed-only", "--preset", "smoke", "--batches", "2", "3"]
    command += ["--prompt-len", "4", "--new-tokens", "3", "--repeat", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for batch in (2, 3):
        ours, theirs = figures[f"b{batch}_engine_tokens_per_s"], figures[f"b{batch}_hf_generate_tokens_per_s"]
        assert ours > 0 and theirs > 0 and figures[f"b{batch}_speedup_vs_hf"] == ours / theirs
        # a decode step of the 2-layer model is dozens of torch calls on either side, the prefill not counted
        calls = figures[f"b{batch}_engine_calls_per_decode_step"], figures[f"b{batch}_hf_calls_per_decode_step"]
        assert all(50 < c < 1000 for c in calls), calls
    assert figures["cpu_bf16"] in ("native", "emulated") and "cpu_onednn_isa_cap" in figures
    assert figures["other_processes_busy_cores"] >= 0
    assert not any(key.startswith(("capture", "fp4_", "linear_", "decode_step")) for key in figures)


def test_a_busy_process_beside_the_timing_is_counted_and_warned_of(capsys):
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started
        figures = {}
        with rollout_benchmark.others_on_the_cores(figures):
            time.sleep(1)
    finally:
        spinner.kill()
    assert figures["other_processes_busy_cores"] >= 0.5  # the loop's core, at least most of it
    assert "other processes kept" in capsys.readouterr().err


def test_batching_only_ends_with_continuous_batching_against_waves_alone():
    """The command behind docs/rollout.md's continuous-batching figures, at the smallest sizes."""
    command = [sys.executable, "benchmarks/rollout.py", "--batching-only", "--preset", "smoke", "--prompt-len", "4"]
    command += ["--batching-rows", "2", "--batching-requests", "5", "--batching-new-tokens", "8", "--repeat", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["batching_same_responses"] is True and figures["batching_requests"] == 5
    # three waves of at most 7 decode steps after their prefills
    assert 0 < figures["batching_continuous_decode_steps"] and 0 < figures["batching_waves_decode_steps"] <= 3 * 7
    assert figures["batching_continuous_over_waves"] == (
        figures["batching_continuous_tokens_per_s"] / figures["batching_waves_tokens_per_s"]
    )
    assert not any(key.startswith(("b2_", "capture", "linear_")) for key in figures)


def test_anatomy_only_splits_a_decode_step_into_its_matmul_and_attention_calls_and_the_rest():
    """The command behind docs/rollout.md's "Where a decode step's time goes", at the smallest sizes: the smoke
    model's 2 layers make 2 x 3 linear layers, 2 x 2 expert matmuls, 2 attention calls and the head (13 calls),
    and answering them from a table leaves the step's other work (how long each takes is the machine's: a noisy
    one may even time the rest above the whole at these sizes)."""
    command = [sys.executable, "benchmarks/rollout.py", "--anatomy-only", "--preset", "smoke", "--batches", "3"]
    command += ["--prompt-len", "4", "--new-tokens", "3", "--repeat", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for batch in (1, 3):
        assert figures[f"b{batch}_matmul_attention_calls"] == 13
        step, rest = figures[f"b{batch}_decode_step_ms"], figures[f"b{batch}_decode_step_rest_ms"]
        assert min(step, rest) > 0 and figures[f"b{batch}_matmul_attention_in_step_ms"] == step - rest
        assert figures[f"b{batch}_matmul_attention_replayed_ms"] > 0
    assert not any(key.startswith(("b2_", "capture", "batching_", "linear_")) for key in figures)


def test_anatomy_replays_the_calls_as_the_step_runs_them(monkeypatch):
    """The replay goes through ``batch_invariant``, as the step does: where bf16 is emulated, the op itself
    would run torch's bf16 kernels (the trap of docs/performance.md), not the step's float32. So each decode
    step more adds the smoke model's 13 calls twice, in the step and in the replay."""
    real, counted = model_module.batch_invariant, []

    def counting(op, *args, **kwargs):
        counted.append(op)
        return real(op, *args, **kwargs)

    monkeypatch.setattr(model_module, "batch_invariant", counting)
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("bf16"))
    totals = []
    for steps in (2, 4):
        counted.clear()
        rollout_benchmark.step_anatomy(engine, 3, 4, steps, repeat=1)
        totals.append(len(counted))
    assert totals[1] - totals[0] == 2 * 2 * 13
