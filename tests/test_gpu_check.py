"""`make gpu-check DRY=1` runs the GPU check's whole plan on the CPU, so that
the command a GPU machine runs cannot rot where there is none."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_the_plan_fits_the_gpu_budget(tmp_path):
    steps = gpu_check.plan("cuda", tmp_path)
    assert [s.name for s in steps] == ["triton_kernel_tests", "kernels", "rollout", "syndrome_codec", "smoke_pipeline"]
    assert sum(s.timeout_s for s in steps) <= gpu_check.GPU_BUDGET_S == 8 * 60


def test_dry_run_runs_the_plan_and_ends_with_its_figures(tmp_path):
    # the plan's own limits stop a slow step first (and name it); this bound only catches a hang outside them
    limits = sum(s.timeout_s for s in gpu_check.plan("cpu", tmp_path) if not s.needs_cuda)
    command = [sys.executable, "benchmarks/gpu_check.py", "--dry-run"]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=limits * gpu_check.DRY_TIME_FACTOR + 120
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    steps = figures["steps"]
    assert figures["mode"] == "dry-run" and figures["cpu"] and figures["cpu_bf16"] in ("native", "emulated")
    assert steps["triton_kernel_tests"]["status"] == "skipped" and "CUDA" in steps["triton_kernel_tests"]["reason"]
    assert "skipped in the dry run" in done.stdout
    kernels, rollout = steps["kernels"]["figures"], steps["rollout"]["figures"]
    assert kernels["device"] == rollout["device"] == "cpu" and kernels["elements"] == 256 * 256
    assert kernels["cpu_bf16"] == rollout["cpu_bf16"] == figures["cpu_bf16"]
    assert rollout["preset"] == "smoke" and rollout["b2_engine_tokens_per_s"] > 0
    assert rollout["linear_decode_tokens_per_s_ctx16"] > 0 and rollout["full_decode_tokens_per_s_ctx16"] > 0
    codec = steps["syndrome_codec"]["figures"]["syndrome"]["speed"]
    assert codec["device"] == "cpu" and codec["elements"] == 256 * 256 and codec["decode_melem_per_s"] > 0
    assert codec["decoded_share"] > 0.9
    assert (
        steps["smoke_pipeline"]["status"] == "passed"
        and steps["smoke_pipeline"]["figures"]["rollout_tokens_per_second"] > 0
    )
