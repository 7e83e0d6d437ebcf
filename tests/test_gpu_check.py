"""`make gpu-check DRY=1` runs the GPU check's whole plan on the CPU, so that
the command a GPU machine runs cannot rot where there is none."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_runs_the_plan_and_ends_with_its_figures():
    command = [sys.executable, "benchmarks/gpu_check.py", "--dry-run"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
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
    assert (
        steps["smoke_pipeline"]["status"] == "passed"
        and steps["smoke_pipeline"]["figures"]["rollout_tokens_per_second"] > 0
    )
