"""`make gpu-check DRY=1` runs the GPU check's whole plan on the CPU, so that
the command a GPU machine runs cannot rot where there is none; and
`make gpu-wheels` picks the wheels a GPU machine without internet needs."""

import importlib.util
import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check, offline_wheels = load("gpu_check"), load("offline_wheels")


def test_the_plan_fits_the_gpu_budget(tmp_path):
    steps = gpu_check.plan("cuda", tmp_path)
    assert [s.name for s in steps] == ["triton_kernel_tests", "kernels", "rollout", "syndrome_codec", "smoke_pipeline"]
    assert sum(s.timeout_s for s in steps) <= gpu_check.GPU_BUDGET_S == 8 * 60
    # issue #13's GPU target compares the engine with generate at 128 new tokens; a dry run's smallest sizes,
    # later on the command line, override it
    rollout = next(s for s in steps if s.name == "rollout")
    assert rollout.command[-2:] == ["--new-tokens", "128"] and "--new-tokens" in rollout.dry_args


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
    assert rollout["batching_same_responses"] is True and rollout["batching_continuous_tokens_per_s"] > 0
    codec = steps["syndrome_codec"]["figures"]["syndrome"]["speed"]
    assert codec["device"] == "cpu" and codec["elements"] == 256 * 256 and codec["decode_melem_per_s"] > 0
    assert codec["decoded_share"] > 0.9
    assert (
        steps["smoke_pipeline"]["status"] == "passed"
        and steps["smoke_pipeline"]["figures"]["rollout_tokens_per_second"] > 0
    )


def test_only_runs_the_named_steps_and_refuses_an_unknown_one():
    command = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--only", "kernels"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"]
    assert list(steps) == ["kernels"] and steps["kernels"]["status"] == "passed"
    command[-1] = "kernel"
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--only kernel: the plan's steps are triton_kernel_tests, kernels" in done.stderr


def test_help_names_the_steps_and_a_machine_without_a_gpu_is_pointed_at_the_dry_run(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--help"])
    with pytest.raises(SystemExit):
        gpu_check.main()
    assert "triton_kernel_tests, kernels, rollout, syndrome_codec, smoke_pipeline" in " ".join(
        capsys.readouterr().out.split()
    )
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main() == 2
    assert "gpu-check needs a CUDA GPU" in (err := capsys.readouterr().err) and "use --dry-run" in err


def test_an_installed_tracefp4_older_than_the_checkout_is_named(tmp_path):
    """The check runs the checkout's tests on the installed library: a stale wheel is refused before any step."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for folder in gpu_check.package_folders().values():
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    assert gpu_check.stale_install(tmp_path) == []  # the editable install here is the checkout
    (tmp_path / "kernels" / "fp4.py").write_text("# a newer commit\n", encoding="utf-8")
    (tmp_path / "components" / "added.py").write_text("", encoding="utf-8")
    assert gpu_check.stale_install(tmp_path) == ["kernels/fp4.py", "components/added.py"]


def test_the_offline_wheels_are_what_the_target_lacks_at_the_versions_here():
    env = offline_wheels.target_environment("3.12", "x86_64")
    needed = offline_wheels.closure(["tracefp4"], ["torch", "nvidia-*"], env)
    # direct and indirect requirements (kfp-server-api only through kfp), pinned to what is installed here
    assert {"pydantic", "pydantic-core", "kfp", "kfp-server-api", "minio", "triton"} <= needed.keys()
    assert needed["pydantic-core"] == metadata.version("pydantic-core")
    assert "torch" not in needed
    # a package the target has is taken with what it requires
    assert "kfp-server-api" not in offline_wheels.closure(["tracefp4"], ["torch", "kfp"], env)
    # requirements' markers are read for the target: tracefp4 asks for triton on x86_64 Linux only
    arm = offline_wheels.target_environment("3.12", "aarch64")
    assert "triton" not in offline_wheels.closure(["tracefp4"], ["torch"], arm)


def test_an_offline_wheel_that_is_not_installed_here_is_named():
    env = offline_wheels.target_environment("3.12", "x86_64")
    with pytest.raises(SystemExit, match="no-such-distribution is required but not installed here"):
        offline_wheels.closure(["no-such-distribution"], [], env)
