"""The ``chain`` task's submission of the next run, in a Python process of its
own: ``python -m tracefp4.pipelines.chain`` reads ``{config_json,
continue_with, job_id}`` as JSON on standard input, calls
:func:`~tracefp4.pipelines.submit.submit_next` and writes its result as the
last line of standard output.

Why a process of its own: KFP's executor runs a component with
``_KFP_RUNTIME=true``, in which ``kfp.dsl`` leaves out the pipeline-authoring
API, so that ``kfp.compiler`` and ``kfp.kubernetes``, which compiling the next
run needs, fail to import there (a circular import, then a missing
``kfp.dsl.PipelineTask``; ``tests/test_submit.py -k chained_smoke`` runs the
task as the executor does)."""

import json
import sys

from tracefp4.pipelines.submit import SubmitError, submit_next
from tracefp4.schemas import ConfigError, RunConfig


def main() -> None:
    request = json.load(sys.stdin)
    config = RunConfig.model_validate_json(request["config_json"])
    try:
        run = submit_next(config, request["continue_with"], request["job_id"], warn=print)
    except (SubmitError, ConfigError, ValueError) as e:  # a failed API call, or no next run to make
        sys.exit(f"chain: {e}")
    print(f"{'submitted' if run['submitted'] else 'submitted before'}: run {run['name']} ({run['run_id']})")
    print(json.dumps(run))


if __name__ == "__main__":
    main()
