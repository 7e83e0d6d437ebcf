"""The local runner: what it reads from the log (progress, the failing
component), resuming a run folder, stopping the running component on a
signal; then the CLI end to end: a failing component, a kill and a resume."""

import builtins
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tracefp4.components.architecture import get_preset as get_model_preset
from tracefp4.components.checkpoint import commit_folder, config_to_hf, save_model, staging_folder, upload_folder
from tracefp4.components.model import build_model
from tracefp4.components.store import open_store
from tracefp4.components.tokenizer import build_tokenizer
from tracefp4.pipelines import resume
from tracefp4.pipelines.cli import main
from tracefp4.pipelines.local import (
    SAME_SIGNAL_S,
    _kfp_local_swaps_undone,
    _Log,
    failed_method,
    failed_task,
    localize,
    progress_state,
    run_local,
    serving_exports,
    unlike_the_run_it_continues,
    warnings_to,
)
from tracefp4.pipelines.pipeline import build_comparison_pipeline, build_pipeline
from tracefp4.schemas import ConfigError, RunConfig, continuation, get_preset, load_config

CLI = [sys.executable, "-m", "tracefp4.pipelines.cli"]

# what kfp.local writes (colours stripped), a cache hit, and a component that bootstraps, then one that fails
LOG = """\
==== 2026-01-01 00:00:00 run id local-1 (resumed)
2026-01-01 00:00:00,001 - INFO - Task prepare cache hit (key=0123456789ab); skipping execution.
10:00:00.000 - INFO - Executing task 'rollout'
10:00:00.000 - INFO - Streamed logs:

    [KFP Executor INFO]: bootstrap step 3/40, loss 2.0
    [KFP Executor INFO]: bootstrap step 4/40, loss 1.9

10:00:01.000 - INFO - Task 'rollout' finished with status SUCCESS
10:00:01.000 - INFO - Executing task 'train'
10:00:01.000 - INFO - Streamed logs:

    Traceback (most recent call last):
      File "/usr/lib/python3/site-packages/kfp/dsl/executor_main.py", line 101, in executor_main
        output_file = executor.execute()
      File "/work/main/components/steps.py", line 9, in train
        raise ValueError("the round's guidance belongs to run local-0")
    ValueError: the round's guidance belongs to run local-0


10:00:02.000 - ERROR - Task 'train' finished with status FAILURE
"""


def test_progress_counts_run_and_reused_tasks_and_shows_the_bootstrap():
    assert progress_state(LOG[: LOG.index("10:00:01.000")]) == (1, "rollout", (4, 40))
    assert progress_state(LOG[: LOG.index("Executing task 'train'") + 30]) == (2, "train", None)
    assert progress_state(LOG) == (2, None, None)


def test_a_failure_names_the_component_and_keeps_its_own_error_without_kfp_frames():
    task, tail = failed_task(LOG)
    assert task == "train"
    assert tail[-1] == "ValueError: the round's guidance belongs to run local-0"
    assert 'File "/work/main/components/steps.py", line 9, in train' in "\n".join(tail)
    assert not [line for line in tail if "kfp" in line or "executor" in line or "INFO" in line]
    # what the component printed before its traceback (kfp's executor input, say) is not its error
    noisy = LOG.replace("    Traceback (most recent", '    },\n    "outputFile": "/tmp/x"\n    Traceback (most recent')
    assert failed_task(noisy) == (task, tail) and tail[0].startswith("Traceback")
    assert failed_task(LOG.replace("FAILURE", "SUCCESS")) is None


def test_a_comparisons_failure_is_its_first_failed_task_and_names_the_method():
    """In a loop kfp.local indents a component's lines by 8, and the failure stops the branch beside it, whose
    task then fails too: the first failure is the one to report, of the method kfp.local's error names (its
    loops innermost first: a rollout worker's inside the methods')."""
    indented = LOG.replace("\n    ", "\n        ")
    killed = "10:00:03.000 - INFO - Executing task 'rollout'\n"
    killed += "10:00:04.000 - ERROR - Task 'rollout' finished with status FAILURE\n"
    task, tail = failed_task(indented + killed)
    assert task == "train" and tail == failed_task(LOG)[1]
    error = "Pipeline 'x' finished with status FAILURE. Inner task failed: 'rollout' inside 'for-loop-4-iteration-1'"
    assert failed_method(error + " inside 'for-loop-2-iteration-0'.", ["trace", "qat"]) == "trace"
    assert failed_method(error + ".", None) is None  # a run's own rollout workers: no method to name


def test_the_log_file_gets_no_colour_codes_and_keeps_earlier_attempts(tmp_path):
    path = tmp_path / "pipeline.log"
    path.write_text("first attempt\n")
    log = _Log(path)
    log.write("Task \x1b[96m'prepare'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m\n")
    log.flush()
    assert path.read_text() == "first attempt\nTask 'prepare' finished with status SUCCESS\n"
    assert log.text() == "Task 'prepare' finished with status SUCCESS\n"  # this attempt's part only


def test_a_log_that_cannot_be_written_stops_once_and_says_why(capsys):
    """A full disk (/dev/full) under the log: each line went on to fail inside
    kfp's print, a chain of logging tracebacks; now the stream goes on to the
    terminal alone, the reason said once, and kept for the run's error."""
    echo = io.StringIO()
    log = _Log(Path("/dev/full"), echo=echo)
    for line in ("one\n", "two\n"):
        assert log.write(line) == len(line)
    log.flush()
    assert echo.getvalue() == "one\ntwo\n"
    assert isinstance(log.lost, OSError) and log.lost.filename == "/dev/full"
    assert capsys.readouterr().err.count("the components' log stopped there") == 1


def test_a_run_folder_keeps_a_run_id_per_request(tmp_path):
    a, b, c = ({"settings": json.dumps({"seed": seed}), "code": "x"} for seed in (1, 2, 3))
    first, resumed, others, _, changed = resume.run_id(tmp_path, a)
    assert first.startswith("local-") and not resumed and others == 0 and changed == ()
    assert resume.run_id(tmp_path, a) == (first, True, 0, None, ())
    second, resumed, others, _, changed = resume.run_id(tmp_path, b)
    assert second != first and not resumed and others == 1 and changed == ("seed 1 -> 2",)
    # back to the first request (a setting undone, an edit reverted): its run resumes, it was not replaced
    assert resume.run_id(tmp_path, a) == (first, True, 1, None, ("seed 2 -> 1",))
    restarted, resumed, others, replaced, _ = resume.run_id(tmp_path, b, restart=True)
    assert restarted != second and not resumed and (others, replaced) == (1, second)
    assert resume.run_id(tmp_path, b)[:2] == (restarted, True)
    assert resume.run_id(tmp_path, c, restart=True).replaced is None  # nothing to restart: a new run
    assert [p.name for p in tmp_path.iterdir()] == [resume.RUN_FILE]  # written through a renamed temporary file
    # a record damaged from outside is refused, naming it, and kept as it is: neither run resumes otherwise
    (tmp_path / resume.RUN_FILE).write_text("{not json")
    for restart in (False, True):
        with pytest.raises(resume.UnreadableRunRecord, match=f"{resume.RUN_FILE}: unreadable .*delete it"):
            resume.run_id(tmp_path, b, restart=restart)
    assert (tmp_path / resume.RUN_FILE).read_text() == "{not json"


def test_a_new_run_of_a_folder_says_what_it_asks_otherwise_than_the_last_one():
    """A rerun that started anew said only that the folder's other runs were asked for "other settings, methods,
    code, checkpoint, problem or reward files or store endpoint": which one, the user had to find out."""
    tasks = [{"name": "sums", "data": "/p.jsonl", "sha256": "ab" * 32}]
    before = {"settings": json.dumps({"seed": 0, "rl": {"rounds": 2}, "tasks": tasks}), "methods": "null", "code": "x"}
    tasks = [{"name": "sums", "data": "/p.jsonl", "sha256": "cd" * 32}]
    now = {"settings": json.dumps({"seed": 0, "rl": {"rounds": 3}, "tasks": tasks}), "methods": "null", "code": "y"}
    assert resume.changes(before, now) == [
        "rl.rounds 2 -> 3",
        'tasks.0.sha256 "abababababababababababa... -> "cdcdcdcdcdcdcdcdcdcdcdc...',
        "tracefp4's code",
    ]
    # a long value is cut around where the two first differ: a checkpoint's path that gained a trailing /
    path = {"settings": json.dumps({"model": {"checkpoint": "/data/checkpoints/qwen3-30b-a3b"}})}
    slash = {"settings": json.dumps({"model": {"checkpoint": "/data/checkpoints/qwen3-30b-a3b/"}})}
    assert resume.changes(path, slash) == ['model.checkpoint ...ckpoints/qwen3-30b-a3b" -> ...ckpoints/qwen3-30b-a3b/"']
    before = {"settings": json.dumps({f"k{i}": 0 for i in range(9)})}
    now = {"settings": json.dumps({f"k{i}": 1 for i in range(9)}), "the files at model.checkpoint": "f"}
    assert resume.changes(before, now, shown=3) == [
        "k0 0 -> 1",
        "k1 0 -> 1",
        "7 more settings",
        "the files at model.checkpoint",
    ]


def test_a_continuation_says_what_it_asks_otherwise_than_the_run_it_continues(tmp_path):
    """--continue-from takes the run's policy, state and round count; its other settings are the command's, and a
    --set the run was given but this command not (model.dtype bfloat16) changed as the run went on, unsaid."""
    run = tmp_path / "run"
    ran = localize(load_config(None, preset="smoke", overrides={"model.dtype": "bfloat16"}), run)
    run_id = resume.run_id(run, {"settings": ran.model_dump_json(), "code": "x"}).run_id
    state = run / "state"
    with staging_folder(state) as tmp:
        (tmp / "optimizer.safetensors").write_text("")
        commit_folder(tmp, state, {"run_id": run_id, "policy_version": 1})
    going_on = continuation(str(run / "policy"), str(state), 1)
    same = load_config(None, preset="smoke", overrides={**going_on, "model.dtype": "bfloat16"})
    assert unlike_the_run_it_continues(run, same, tmp_path / "next") == []  # its own continuation settings apart
    other = load_config(None, preset="smoke", overrides=going_on)
    assert unlike_the_run_it_continues(run, other, tmp_path / "next") == ['model.dtype "bfloat16" -> "float32"']


def test_a_runs_serving_exports_are_its_finished_export_tasks_by_method(tmp_path):
    """The folder of another run's export, and of one its task did not finish (no cache entry names it, as
    :func:`resume.finished_outputs` reads them), are not the run's; a comparison's is its method's."""
    finished = {}
    for attempt, iteration, run_id, done in [
        ("first", "", "local-other", True),
        ("second", "for-loop-2-iteration-0/", "local-this", True),
        ("second", "for-loop-2-iteration-1/", "local-this", True),
        ("third", "for-loop-2-iteration-1/", "local-this", False),  # killed while it wrote
    ]:
        folder = tmp_path / resume.PIPELINE_ROOT / attempt / iteration / "export" / "exported"
        with staging_folder(folder) as tmp:
            (tmp / "config.json").write_text("{}")
            commit_folder(tmp, folder, {"run_id": run_id, "policy_version": 1, "format": "nvfp4-pack-quantized"})
        if done:
            finished[f"{attempt}{iteration}"] = {"exported": {"__kfp_artifact__": True, "uri": str(folder)}}
    (tmp_path / resume.COMPLETED).mkdir()
    for key, outputs in finished.items():
        (tmp_path / resume.COMPLETED / f"{hashlib.sha256(key.encode()).hexdigest()}.json").write_text(
            json.dumps(outputs)
        )
    root = tmp_path / resume.PIPELINE_ROOT
    assert serving_exports(tmp_path, "local-this", ["trace", "bf16"]) == {
        "trace": root / "second" / "for-loop-2-iteration-0" / "export" / "exported",
        "bf16": root / "second" / "for-loop-2-iteration-1" / "export" / "exported",
    }
    assert serving_exports(tmp_path, "local-other") == {None: root / "first" / "export" / "exported"}
    assert serving_exports(tmp_path, "local-none") == {}


def test_a_checkpoint_with_other_weights_at_the_same_path_is_another_run(tmp_path):
    """The request holds the checkpoint's fingerprint: re-bootstrapping into the same folder starts a new run."""
    data = get_preset("smoke").model_dump()
    data["model"] |= {"preset": None, "checkpoint": str(tmp_path / "base")}
    config = RunConfig.model_validate(data)
    save_model(build_model("smoke", seed=1), tmp_path / "base")
    store = open_store((tmp_path / "store").as_uri())
    before = resume.request(config, None, store)
    assert resume.request(config, None, store) == before
    save_model(build_model("smoke", seed=2), tmp_path / "base")
    assert resume.request(config, None, store) != before
    (tmp_path / "base" / "checksums.json").unlink()  # without a manifest: the files' sizes and times
    unverified = resume.request(config, None, store)
    (tmp_path / "base" / "config.json").write_text((tmp_path / "base" / "config.json").read_text() + " ")
    assert resume.request(config, None, store) != unverified
    # a checkpoint that is not there stops the run before it starts, naming the field (prepare failed on it)
    config = config.model_copy(update={"model": config.model.model_copy(update={"checkpoint": "/nonexistent/x"})})
    with pytest.raises(ConfigError, match="model.checkpoint: /nonexistent/x: no such folder"):
        resume.request(config, None, store)


def test_an_s3_store_on_another_server_is_another_run(s3_env, tmp_path, monkeypatch):
    """The same bucket behind another TRACEFP4_S3_ENDPOINT holds none of a
    run's finished outputs, which a rerun there resumed. The request holds the
    endpoint the store is opened with, in the steps' environment: a config's
    store.endpoint before this process's (the run was refused for lacking
    the variable the steps would have been given)."""
    config = load_config(None, preset="smoke", overrides={"store.uri": s3_env.uri("resume")})
    first = resume.request(config, None, open_store(config.store.uri))
    assert resume.request(config, None, open_store(config.store.uri)) == first
    other = f"localhost:{s3_env.endpoint.rpartition(':')[2]}"  # the test's one server, named otherwise
    monkeypatch.setenv("TRACEFP4_S3_ENDPOINT", other)
    assert resume.request(config, None, open_store(config.store.uri)) != first

    def started(output, request, restart):
        fingerprint = request["the files at model.checkpoint"]
        raise RuntimeError(f"started; store endpoint {request['store endpoint']}, checkpoint {fingerprint}")

    # a checkpoint in the store is fingerprinted there too (it was read with this process's settings alone), and
    # its config and tokenizer read there before the run starts
    policy = save_model(build_model("smoke"), tmp_path / "policy", extra=build_tokenizer().files())
    upload_folder(policy, open_store(s3_env.uri("checkpoint")))
    monkeypatch.delenv("TRACEFP4_S3_ENDPOINT")
    monkeypatch.setattr(resume, "run_id", started)
    pinned = config.model_copy(
        update={
            "store": config.store.model_copy(update={"endpoint": f"http://{other}"}),
            "model": config.model.model_copy(update={"checkpoint": s3_env.uri("checkpoint")}),
        }
    )
    with pytest.raises(RuntimeError, match=f"started; store endpoint http://{other}, checkpoint [0-9a-f]{{64}}$"):
        run_local(pinned, tmp_path / "run")


def test_a_run_folder_takes_one_run_at_a_time(tmp_path):
    lock = resume.lock_folder(tmp_path)
    with pytest.raises(resume.FolderInUse, match=rf"{tmp_path} is in use by another run \(pid {os.getpid()}\)"):
        resume.lock_folder(tmp_path)
    lock.close()  # the run ended
    resume.lock_folder(tmp_path).close()


def test_a_run_refuses_a_folder_of_files_that_are_not_a_runs(tmp_path):
    """`--output .` in a project's root wrote the run among its files; a folder
    that a run was killed in before it recorded its run id (the lock's file
    alone) is a run folder still."""
    (tmp_path / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["run", "--preset", "smoke", "--output", str(tmp_path)])
    expected = f"Error: {tmp_path} holds files and is not a tracefp4 run folder (it has no run.json): a run would"
    assert result.exit_code == 1 and result.output.startswith(expected), result.output
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    (tmp_path / "notes.txt").unlink()
    resume.check_run_folder(tmp_path)  # empty
    resume.lock_folder(tmp_path).close()
    (tmp_path / "pipeline.log").write_text("")
    resume.check_run_folder(tmp_path)


def test_a_run_no_local_machine_can_do_is_refused_before_it_starts(tmp_path, monkeypatch):
    """A TrainJob launcher failed in the train step, after prepare (minutes of
    bootstrap for tiny) and the rollout; a comparison branch that could not run
    failed in its configure task, with its run recorded in the folder; a store
    the steps cannot reach failed in the rollout."""
    from tracefp4.components.store import StoreError

    for name in ("TRACEFP4_S3_ENDPOINT", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    s3 = load_config(None, preset="smoke", overrides={"store.uri": "s3://bucket/prefix"})
    with pytest.raises(StoreError, match="set TRACEFP4_S3_ENDPOINT"):
        run_local(s3, tmp_path / "s3")
    assert not (tmp_path / "s3").exists()
    ranks = {"train.launcher": "trainjob", "train.processes_per_node": 2, "train.precision": "fp32_master"}
    trainjob = load_config(None, preset="smoke", overrides={**ranks, "rl.microbatch_size": 2})
    with pytest.raises(ConfigError, match="train.launcher: trainjob creates a Kubeflow Trainer TrainJob"):
        run_local(trainjob, tmp_path / "trainjob")
    assert not (tmp_path / "trainjob").exists()
    fp4_kv = load_config(None, preset="smoke", overrides={"rollout.config": "fp4_kv"})
    with pytest.raises(ConfigError, match="branch of method quads"):
        run_local(fp4_kv, tmp_path / "compare", methods=["trace", "quads"])
    assert not (tmp_path / "compare").exists()  # no run recorded, no folder made


def test_a_checkpoint_that_is_no_policy_is_refused_before_the_run_starts(tmp_path):
    """A run folder, a serving export, a folder without config.json or without its tokenizer, or whose
    tokenizer outgrows the model's vocabulary, given as model.checkpoint failed in prepare, the run started,
    with a traceback."""
    config = get_preset("smoke")
    run_folder = tmp_path / "earlier"
    run_folder.mkdir()
    (run_folder / resume.RUN_FILE).write_text("{}")
    exported = tmp_path / "exported"
    exported.mkdir()
    hf = {**config_to_hf(get_model_preset("tiny")), "quantization_config": {"quant_method": "compressed-tensors"}}
    (exported / "config.json").write_text(json.dumps(hf))
    (tmp_path / "empty").mkdir()
    untokenized, small = tmp_path / "untokenized", tmp_path / "small"
    for folder, vocab_size in [(untokenized, 1000), (small, 8)]:
        folder.mkdir()
        hf = {**config_to_hf(get_model_preset("tiny")), "vocab_size": vocab_size}
        (folder / "config.json").write_text(json.dumps(hf))
    for name, data in build_tokenizer().files().items():
        (small / name).write_bytes(data)
    for folder, problem in [
        (run_folder, f"{run_folder} is a tracefp4 run folder, not a policy (a train task's new_policy under"),
        (run_folder, f"; to go on from its run: --continue-from {run_folder}"),
        (exported, "a quantized checkpoint (quantization_config, compressed-tensors)"),
        (tmp_path / "empty", f"{tmp_path / 'empty' / 'config.json'} does not exist"),
        (untokenized, "does not exist: a checkpoint folder must carry its tokenizer"),
        (small, f"{small}: tokenizer.json holds {build_tokenizer().vocab_size} tokens, more than config.json's"),
    ]:
        asked = config.model_copy(
            update={"model": config.model.model_copy(update={"preset": None, "checkpoint": str(folder)})}
        )
        with pytest.raises(ConfigError, match="model.checkpoint") as refused:
            run_local(asked, tmp_path / "run")
        assert problem in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_a_run_that_fails_to_start_releases_its_folder(tmp_path, monkeypatch):
    def refuse(output, request, restart):
        raise RuntimeError("cannot write run.json")

    monkeypatch.setattr(resume, "run_id", refuse)  # inside the folder's lock
    with pytest.raises(RuntimeError, match="cannot write run.json") as failed:
        run_local(get_preset("smoke"), tmp_path)
    assert failed.traceback  # held, with its frames: the folder is free all the same
    resume.lock_folder(tmp_path).close()


def test_the_code_digest_follows_the_code(tmp_path, monkeypatch):
    """A run folder resumes only on the code that began it: kfp.local's task cache
    keys a component's own lines, not the library code they call."""
    digest = resume.code_digest()
    assert digest == resume.code_digest() and len(digest) == 64
    package = tmp_path / "fake"
    package.mkdir()
    (package / "steps.py").write_text("STEP = 1\n")
    monkeypatch.setattr(resume, "PACKAGES", ("fake",))
    monkeypatch.syspath_prepend(str(tmp_path))
    before = resume.code_digest()
    (package / "steps.py").write_text("STEP = 2\n")
    assert resume.code_digest() != before


def test_local_pipelines_cache_every_task_and_never_retry():
    config = get_preset("smoke")
    comparison = build_comparison_pipeline(config, ["trace", "qat"], retries=False)
    for pipeline in (build_pipeline(config, retries=False), comparison):
        resume.cache_every_task(pipeline, "local-0")
        spec = pipeline.pipeline_spec
        dags = [spec.root.dag] + [c.dag for c in spec.components.values() if c.WhichOneof("implementation") == "dag"]
        tasks = [task for dag in dags for task in dag.tasks.values()]
        assert len(tasks) >= 6
        assert all(task.caching_options.enable_cache for task in tasks)
        assert not [task for task in tasks if task.retry_policy.max_retry_count]


def test_metrics_outputs_get_a_file_for_the_cache_to_find(tmp_path):
    class Metrics:  # what a component's Output[Metrics] offers
        path, metadata = str(tmp_path / "metrics"), {"bootstrap_accuracy": 0.25}

    resume.write_metrics(Metrics())
    assert json.loads((tmp_path / "metrics").read_text()) == {"bootstrap_accuracy": 0.25}


def terminated_runner(tmp_path, body: str, ready, again_after_s: float | None = None) -> int:
    """Run ``body`` inside ``_stop_components`` in a runner process, send it SIGTERM once the file ``ready``
    has content (a component runs), and again ``again_after_s`` later where given, and return the runner's exit
    status (128 + SIGTERM if it stopped)."""
    lines = [
        "import concurrent.futures, subprocess, sys, time",
        "from tracefp4.pipelines.local import Interrupted, _Log, _stop_components",
        "try:",
        f"    with _stop_components(_Log({str(tmp_path / 'log')!r})):",
        *("        " + line for line in body.strip().splitlines()),
        "except Interrupted as e:",
        "    sys.exit(128 + e.signum)",
    ]
    script = tmp_path / "runner.py"
    script.write_text("\n".join(lines) + "\n")
    runner = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    runner.send_signal(signal.SIGTERM)
    if again_after_s is not None:
        time.sleep(again_after_s)
        runner.send_signal(signal.SIGTERM)
    return runner.wait(timeout=30)


@pytest.mark.parametrize(
    "shell, then",
    [
        # kfp.local runs a component as ``sh -c`` around python, in the runner's process group: killing only
        # the runner's child (sh) would orphan python
        ("{component}; echo still here", ""),
        # sh stopped as it forks python leaves python running without a parent, on the run folder's lock: the
        # runner adopts it, so that it is found and stopped (a rerun once found the folder held by such a one)
        ("{component} & exit", "time.sleep(60)"),
    ],
    ids=["under-sh", "orphaned"],
)
def test_a_signal_to_the_runner_stops_the_component_it_started(tmp_path, shell, then):
    pid_file = tmp_path / "pid"
    component = tmp_path / "component.py"
    component.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    script = shell.format(component=f"{sys.executable} {component}")
    body = f'subprocess.run(["sh", "-c", "{script}"])\n{then}'
    assert terminated_runner(tmp_path, body, pid_file) == 128 + signal.SIGTERM
    assert not _running(int(pid_file.read_text()))


def test_a_signal_delivered_twice_at_once_stops_the_components_as_one_does(tmp_path):
    """GNU timeout signals the command, then its process group: the second copy, while the components stop,
    leaves their stopping alone; a signal a while later ends the runner as before, not waiting for them."""
    component = tmp_path / "component.py"
    component.write_text(  # it takes 2 s to stop, or never
        "import signal, sys, time\n"
        f"import os\nslow = sys.argv[1] == 'slow'\nopen({str(tmp_path)!r} + '/ready', 'w').write(str(os.getpid()))\n"
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), sys.exit(0)) if slow else None)\n"
        "time.sleep(120)\n"
    )
    for how, status in (("slow", 128 + signal.SIGTERM), ("never", -signal.SIGTERM)):
        (tmp_path / "ready").unlink(missing_ok=True)
        body = f'subprocess.run([sys.executable, "{component}", "{how}"])'
        again_after_s = 0.1 if how == "slow" else SAME_SIGNAL_S + 0.5
        assert terminated_runner(tmp_path, body, tmp_path / "ready", again_after_s) == status, how
    os.kill(int((tmp_path / "ready").read_text()), signal.SIGKILL)  # the one that never stops, left by its runner


def test_after_a_signal_the_components_a_loop_starts_later_are_stopped_too(tmp_path):
    """kfp.local runs a loop's iterations in a thread pool and, interrupted, still starts the queued ones (its
    pool's shutdown waits for them) before it raises: they are stopped as they start, so that the runner ends."""
    started = tmp_path / "started"
    component = f"import time; open({str(started)!r}, 'a').write('x'); time.sleep(120)"
    body = f"""
def iteration():
    subprocess.run([sys.executable, "-c", {component!r}])
with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:  # the second iteration queued
    concurrent.futures.wait([pool.submit(iteration) for _ in range(2)])
"""
    assert terminated_runner(tmp_path, body, started) == 128 + signal.SIGTERM
    assert started.read_text() == "xx"  # the queued iteration started, and was stopped


KILLED_RUNNER = """\
import sys
from pathlib import Path

import kfp.local
from kfp import dsl

from tracefp4.pipelines import resume


@dsl.component(install_kfp_package=False)
def sleeper(pid_file: str):
    import os
    import time

    open(pid_file, "w").write(str(os.getpid()))
    time.sleep(120)


@dsl.pipeline
def pipeline(pid_file: str):
    sleeper(pid_file=pid_file)


folder = Path(sys.argv[1])
lock = resume.lock_folder(folder)
resume.hold_folder_lock(pipeline, folder)
kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(folder / resume.PIPELINE_ROOT))
pipeline(pid_file=sys.argv[2])
"""


def test_a_run_killed_with_sigkill_leaves_its_folder_locked_until_its_task_ends(tmp_path):
    """SIGKILL stops no component (the runner gets no signal handler in): the
    one running went on writing in the folder, whose lock the rerun took
    at once. Each task holds the lock too, inherited from kfp.local's own
    subprocess, so the rerun stops, naming the task, until it has ended."""
    script, pid_file = tmp_path / "runner.py", tmp_path / "pid"
    script.write_text(KILLED_RUNNER)
    runner = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(pid_file)], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert runner.poll() is None, "the runner ended before its task started"
            time.sleep(0.1)
        runner.kill()
        runner.wait(timeout=30)
        task = int(pid_file.read_text())
        assert _running(task)
        expected = (
            rf"in use by pid\(s\) [\d, ]*\b{task}\b.*, task\(s\) of an earlier run \(pid {runner.pid}\) that ended"
        )
        with pytest.raises(resume.FolderInUse, match=expected):
            resume.lock_folder(tmp_path)
        os.kill(task, signal.SIGKILL)  # the task's shell ends with it
        deadline = time.monotonic() + 30
        while True:
            try:
                resume.lock_folder(tmp_path).close()
                break
            except resume.FolderInUse:
                assert time.monotonic() < deadline, "the folder stayed locked after its task ended"
                time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)  # whatever of the run is left


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_a_checkpoint_and_the_run_against_it_are_checked_before_the_run_starts(tmp_path):
    """None, pickles alone, or shapes config.json does not describe: refused before the run starts (found by
    prepare before, a traceback after the configure task), as the folder's config and tokenizer are, and the
    run's guided layers and prompts against them."""
    folder = save_model(build_model("smoke"), tmp_path / "policy", extra=build_tokenizer().files())
    checkpoint = {"model.checkpoint": str(folder)}
    config = load_config(None, preset="smoke", overrides=checkpoint)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(hf | {"moe_intermediate_size": 96}))
    with pytest.raises(ConfigError, match=r"model.checkpoint: .*has shape \[64, 64\], but config.json implies \[96,"):
        run_local(config, tmp_path / "run")
    (folder / "config.json").write_text(json.dumps(hf))
    # the run against the checkpoint's layers and tokenizer, as prepare checks it: its guided layers, its prompts
    for overrides, refusal in [
        ({"guidance.layers": [5]}, f"guidance.layers: layer 5 does not exist; checkpoint {folder} has 2"),
        ({"rollout.max_new_tokens": 60}, "model.max_seq_len: a prompt of "),
    ]:
        with pytest.raises(ConfigError, match=re.escape(refusal)):
            run_local(load_config(None, preset="smoke", overrides={**checkpoint, **overrides}), tmp_path / "run")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"no model.safetensors .*found pickle files \['pytorch_model.bin'\]"):
        run_local(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_config_check_reads_the_checkpoint_and_warns_of_weights_the_run_takes_to_another_dtype(tmp_path):
    """config --check read no checkpoint: one that is not there passed, which the run refused at once. A bf16
    checkpoint in a run of the schema's float32 ran in float32 without a word (twice its memory and bytes)."""
    folder = save_model(
        build_model("smoke", dtype=torch.bfloat16), tmp_path / "policy", extra=build_tokenizer().files()
    )
    command = ["config", "--preset", "smoke", "--set", f"model.checkpoint={folder}", "--check"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    assert (
        f"warning: model.checkpoint {folder} holds bfloat16 weights; the run rolls them out and trains them in "
        "model.dtype float32" in result.stderr
    )
    assert "warning" not in CliRunner().invoke(main, [*command, "--set", "model.dtype=bfloat16"]).stderr
    result = CliRunner().invoke(main, [*command[:4], "model.checkpoint=~/none", "--check"])  # no shell expands it
    assert (
        result.exit_code == 1
        and "model.checkpoint: ~/none/config.json does not exist: ~/none is no folder (~ is no home folder here"
        in result.output
    )


def test_a_warning_before_the_run_starts_is_said_as_one():
    """The checks before a run's log is open (a checkpoint without a chat template) warned with Python's handler
    of last resort: a bare line on standard error, among the command's own lines on standard output."""
    said = io.StringIO()
    with warnings_to(said):
        logging.getLogger("tracefp4.checkpoint").warning("%s has no chat template", "policy")
    logging.getLogger("tracefp4.checkpoint").warning("after the checks")
    assert said.getvalue() == "warning: policy has no chat template\n"  # the handler gone after the checks


def test_cli_reports_the_failing_component_and_its_error_once(tmp_path):
    # a policy whose weights changed after it was saved: prepare fails on it, reading every byte against the
    # checksums (what is no policy, holds no weights, no tokenizer or a broken one, is refused before the run starts)
    folder = save_model(build_model("smoke"), tmp_path / "checkpoint", extra=build_tokenizer().files())
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[-5] ^= 0xFF  # a weight's bits, not the header's
    (folder / "model.safetensors").write_bytes(bytes(weights))
    config = tmp_path / "changed-checkpoint.yaml"
    config.write_text(f"model:\n  checkpoint: {folder}\n")
    out = tmp_path / "run"
    command = [*CLI, "run", "--preset", "smoke", "--config", str(config), "--output", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "component prepare failed" in result.stderr
    assert f"{folder / 'model.safetensors'}: sha256 does not match checksums.json: corrupt" in result.stderr
    assert "RuntimeError" not in result.stderr and "kfp" not in result.stderr
    log = (out / "pipeline.log").read_text()
    assert "\x1b" not in log + result.stdout + result.stderr
    assert log.count("Executing task 'prepare'") == 1  # no retry
    assert "\r" not in result.stdout  # the progress as plain lines when stdout is not a terminal
    # a new run (--restart, as changed code) runs configure again: it takes no run id, and its cache entry was
    # reused by every later run of the folder, the result and the checks of the first one's code
    restarted = subprocess.run([*command, "--restart"], capture_output=True, text=True, timeout=300)
    assert restarted.returncode == 1 and "component prepare failed" in restarted.stderr
    first_id = re.search(r"run id (local-\w+)", result.stdout)[1]
    assert f"a new run (--restart): {first_id}, the folder's earlier run of these settings" in restarted.stdout
    rerun = (out / "pipeline.log").read_text().split("==== ")[-1]
    assert "Executing task 'configure'" in rerun and "cache hit" not in rerun


def test_cli_killed_after_prepare_resumes_without_running_prepare_again(tmp_path):
    out = tmp_path / "run"
    command = [*CLI, "run", "--preset", "smoke", "--output", str(out)]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "pipeline.log"
    deadline = time.monotonic() + 240
    while "Executing task 'rollout'" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.2)  # prepare's outputs are recorded before the next task starts
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM and "rerun the same command to resume" in err
    attempt = log.read_text().count("Executing task")
    second = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "resumed" in second.stdout and "# tracefp4 run `smoke`" in second.stdout
    # it ends with files to open: the report copied into the run folder with extensions (KFP names the report
    # task's artifacts page and markdown, which a browser shows as text), and where its serving export is (it
    # said neither)
    report = next(out.glob("pipeline_root/*/report/markdown"))
    exported = next(out.glob("pipeline_root/*/export/exported"))
    assert second.stdout.splitlines()[-2:] == [
        f"report: {out / 'report.html'} (open it in a browser), {out / 'report.md'} (markdown)",
        f"serving export: {exported} (nvfp4-pack-quantized, for vLLM and SGLang: docs/export.md)",
    ]
    assert (out / "report.md").read_bytes() == report.read_bytes()
    assert (out / "report.html").read_bytes() == report.with_name("page").read_bytes()
    # tracefp4 report copies the report it shows there too (a run folder of an earlier tracefp4 has none), and
    # warns where it cannot; it ends as the run did, with the serving export of the report's run
    (out / "report.html").unlink()
    shown = CliRunner().invoke(main, ["report", str(out)])
    assert shown.exit_code == 0 and shown.output.splitlines()[-2:] == second.stdout.splitlines()[-2:]
    assert (out / "report.html").read_bytes() == report.with_name("page").read_bytes()
    (out / "report.md").unlink()
    (out / "report.md").mkdir()  # in the way
    shown = CliRunner().invoke(main, ["report", str(out)])  # the report shown all the same, with a warning
    message = (
        f"warning: {out}: could not copy the report there as report.html and report.md (Is a directory); it is "
        f"{report.with_name('page')} (HTML) and {report} (markdown)"
    )
    # the warning first (the report is copied before it is said), the report, then its export
    assert shown.exit_code == 0 and shown.output.startswith(message + "\n" + report.read_text())
    assert shown.output.splitlines()[-1] == second.stdout.splitlines()[-1]
    rerun = log.read_text().split("==== ")[-1]
    assert "Task configure cache hit" in rerun and "Task prepare cache hit" in rerun
    assert "Executing task 'prepare'" not in rerun
    assert "Executing task 'rollout'" in rerun and attempt >= 2


def test_what_two_loop_iterations_of_kfp_local_swap_at_once_is_undone():
    """kfp.local's own contexts, entered as two loop iterations of a comparison
    interleave them: each restores what it found, the other's, and one stays."""
    from kfp.local import logging_utils

    root = logging.getLogger()
    printer, handlers, level = builtins.print, list(root.handlers), root.level
    with _kfp_local_swaps_undone():
        first, second = contextlib.ExitStack(), contextlib.ExitStack()
        for iteration in (first, second):
            iteration.enter_context(logging_utils.local_logger_context())
            iteration.enter_context(logging_utils.indented_print())
        first.close()
        second.close()
        assert builtins.print is not printer and root.handlers != handlers  # what kfp.local leaves on its own
    assert builtins.print is printer and root.handlers == handlers and root.level == level
