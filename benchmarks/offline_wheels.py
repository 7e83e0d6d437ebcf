"""The wheels a GPU machine without internet needs to run the GPU check
(``benchmarks/gpu_check.py``): tracefp4's own, and every runtime dependency
that the machine's Python lacks, at the versions installed here (the ones the
tests ran against), for that machine's Python and architecture.

    python benchmarks/offline_wheels.py --output .whl [--python 3.12] [--machine x86_64] [--have NAME ...]

``--have`` names what the machine's Python already holds (default: a CUDA
PyTorch image's torch, triton and nvidia-* libraries); a package named there
is taken with everything it requires, so the bundle stays small. On the
machine, from the repository root:

    python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py

Where PyPI has no wheel of a dependency (kfp-server-api publishes only its
source), its wheel is built here; that works for pure-Python packages only, and
any other is refused with its name. The last line is one JSON object: the
wheels and their total size.
"""

import argparse
import fnmatch
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HAVE = ("torch", "triton", "nvidia-*")
EXTRAS = ("torchao",)  # benchmarks/fp4_kernels.py compares against its eager NVFP4 quantize
MANYLINUX = [f"manylinux_2_{minor}" for minor in range(17, 40)] + ["manylinux2014", "manylinux1"]


def target_environment(python: str, machine: str) -> dict[str, str]:
    """Marker values of the target: Linux, ``machine``, CPython ``python``."""
    return default_environment() | {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": machine,
    }


def target_has(name: str, have: list[str]) -> bool:
    """Whether ``name`` matches one of the globs of what the target holds."""
    return any(fnmatch.fnmatch(canonicalize_name(name), canonicalize_name(p)) for p in have)


def closure(roots: list[str], have: list[str], env: dict[str, str]) -> dict[str, str]:
    """Name -> installed version of every distribution ``roots`` need on the
    target, through their requirements (extras left out), not descending into
    a package the target has."""
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found or target_has(name, have):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is required but not installed here: run make install-dev first") from None
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env | {"extra": ""}):
                todo.append(req.name)
    return found


def fetch(name: str, version: str, python: str, machine: str, out: Path) -> None:
    """The target's wheel of ``name==version`` from the index; else one built here, if pure Python."""
    platforms = [arg for tag in MANYLINUX for arg in ("--platform", f"{tag}_{machine}")]
    pin = f"{name}=={version}"
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out)]
    target = ["--python-version", python, "--implementation", "cp", *platforms]
    if subprocess.run([*download, *target, pin], capture_output=True).returncode == 0:
        return
    with tempfile.TemporaryDirectory() as tmp:
        build = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, pin], capture_output=True, text=True
        )
        if build.returncode:
            raise SystemExit(
                f"{pin}: no wheel for Python {python} on {machine}, and building one failed:\n{build.stderr}"
            )
        (wheel,) = Path(tmp).glob("*.whl")
        if not all(tag.abi == "none" and tag.platform == "any" for tag in parse_wheel_filename(wheel.name)[3]):
            raise SystemExit(f"{pin}: no wheel for Python {python} on {machine}, and it is not pure Python")
        wheel.rename(out / wheel.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="folder for the wheels")
    parser.add_argument("--python", default="3.12", help="the target's Python, major.minor")
    parser.add_argument("--machine", default="x86_64", choices=["x86_64", "aarch64"])
    parser.add_argument("--have", nargs="*", default=list(DEFAULT_HAVE), help="what the target has (globs)")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    for old in args.output.glob("*.whl"):
        old.unlink()  # one version of each: two would stop the install
    needed = closure(["tracefp4", *EXTRAS], args.have, target_environment(args.python, args.machine))
    needed.pop("tracefp4")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(args.output), str(ROOT)], check=True
    )
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda item: fetch(*item, args.python, args.machine, args.output), sorted(needed.items())))
    wheels = sorted(p.name for p in args.output.glob("*.whl"))
    size = sum(p.stat().st_size for p in args.output.glob("*.whl"))
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.output}")
    print(json.dumps({"python": args.python, "machine": args.machine, "wheels": wheels, "bytes": size}))


if __name__ == "__main__":
    main()
