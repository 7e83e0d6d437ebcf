"""The Kubeflow Pipelines DAG: compile, version, submit, local runner and CLI."""

import sys


def main() -> None:
    """The ``tracefp4`` command (:mod:`.cli`), imported here: a Ctrl-C while
    torch and kfp load, a second or two, ends it with a line and exit status
    130 (nothing ran yet), not an import's traceback."""
    try:
        from tracefp4.pipelines.cli import main as cli
    except KeyboardInterrupt:
        print("tracefp4: interrupted while starting; nothing ran", file=sys.stderr)
        raise SystemExit(130) from None
    cli()
