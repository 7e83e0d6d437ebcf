"""The wheel installs one top-level package, `tracefp4`, whose subpackages
import from a fresh virtual environment."""

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["kernels", "components", "pipelines", "schemas"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    tracked = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    for name in tracked.stdout.split():
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("tracefp4-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_has_no_top_level_module_but_tracefp4(wheel):
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tracefp4"}
    for forbidden in SUBPACKAGES:
        assert forbidden not in tops


@pytest.mark.slow
def test_every_subpackage_imports_from_a_fresh_venv(wheel, tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    with zipfile.ZipFile(wheel) as whl:  # install by unpacking: the wheel's own files only
        whl.extractall(site)
    # dependencies (torch, ...) come from this interpreter's site-packages, added as a
    # plain path so that its .pth files (the editable install of this checkout) stay out
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import importlib, pathlib, sys\n"
        f"for name in {SUBPACKAGES!r}:\n"
        "    mod = importlib.import_module('tracefp4.' + name)\n"
        f"    assert pathlib.Path(mod.__file__).is_relative_to({str(env)!r}), mod.__file__\n"
        "import tracefp4.kernels as k, torch\n"
        "assert k.quantize(torch.ones(1, 16), 'nvfp4').codes.shape == (1, 8)\n"
    )
    subprocess.run([python, "-c", code], check=True, cwd=tmp_path)


def test_the_repository_folders_shadow_no_installed_module():
    """A top-level ``kernels`` import reaches the installed package of that name (transformers' model code imports
    it) or nothing, never this repository's kernels/ folder, which conftest keeps off sys.path. The folders that are
    first on sys.path where their scripts run (benchmarks/, tests/) name no module an installed distribution has."""
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin).parent != ROOT / "kernels", spec.origin
    from transformers.models.qwen3_moe import modeling_qwen3_moe  # imports `kernels` in transformers 5.25 on

    assert modeling_qwen3_moe.Qwen3MoeForCausalLM
    installed = importlib.metadata.packages_distributions()
    for folder in ("benchmarks", "tests"):
        scripts = {path.stem for path in (ROOT / folder).glob("*.py")}
        assert not scripts & set(installed), {name: installed[name] for name in scripts & set(installed)}
