"""The Kubeflow Pipelines DAG: compile, version, submit, local runner and CLI."""

import os
import sys
from pathlib import Path


def main() -> None:
    """The ``tracefp4`` command (:mod:`.cli`), imported here: a Ctrl-C while
    it loads (half a second; torch and kfp load later, in the commands that
    need them) ends it with a line and exit status 130 (nothing ran yet), not
    an import's traceback.

    Run as ``python -m`` (``make run``), Python puts the working directory
    first on sys.path, and so do the Pythons it starts there: kfp.local's
    components and torchrun's ranks (``python -m`` too). In a checkout's root
    that directory holds the ``kernels/`` folder installed as
    ``tracefp4.kernels``, which then shadows the ``kernels`` package
    transformers imports for its model code. This process drops it (tracefp4
    is imported from where it is installed) and those it starts do not put it
    there (``PYTHONSAFEPATH``)."""
    if not sys.flags.safe_path and sys.path and Path(sys.path[0] or os.curdir).resolve() == Path.cwd().resolve():
        del sys.path[0]
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        from tracefp4.pipelines.cli import main as cli
    except KeyboardInterrupt:
        print("tracefp4: interrupted while starting; nothing ran", file=sys.stderr)
        raise SystemExit(130) from None
    cli()
