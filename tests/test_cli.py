"""The CLI and config loading refuse bad input with one clear message, before
anything runs."""

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import get_args

import click
import pytest
import torch
import yaml
from click.testing import CliRunner

from tracefp4.components.checkpoint import fetch, load_model
from tracefp4.components.tokenizer import build_tokenizer, load_tokenizer
from tracefp4.pipelines.cli import main
from tracefp4.schemas import ConfigError, Method, load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "methods, message",
    [
        ("trace,nope", "unknown method(s) nope"),
        ("trace,qat,trace", "method(s) trace named more than once"),
        ("", "a comparison needs at least one method"),  # it said "unknown method(s) ;", naming none
        (" , ", "a comparison needs at least one method"),
    ],
)
def test_compare_rejects_unknown_and_repeated_methods(tmp_path, methods, message):
    args = ["run", "--preset", "smoke", "--output", str(tmp_path / "run"), "--compare", methods]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and message in result.output and "--compare" in result.output
    if "nope" in methods:
        assert all(m in result.output for m in get_args(Method))  # the valid choices are named
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_a_second_config_file_is_refused_not_dropped(tmp_path):
    """click kept the last --config: a run's own file given before a continuation's settings was dropped, and
    the run went on the schema's defaults."""
    first, second = tmp_path / "mine.yaml", tmp_path / "continue.yaml"
    first.write_text("rl:\n  learning_rate: 0.001\n")
    second.write_text("rl:\n  first_round: 1\n")
    result = CliRunner().invoke(main, ["config", "--config", str(first), "--config", str(second)])
    assert result.exit_code == 2 and f"given 2 times ({first}, {second}): give one file" in result.output


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml.*\n.*not UTF-8 text: byte 0xe9 at offset 9"):
        load_config(path)
    result = CliRunner().invoke(main, ["compile", "--config", str(path), "--output", str(tmp_path / "p.yaml")])
    assert result.exit_code == 1 and "not UTF-8" in result.output and "Traceback" not in result.output


def test_an_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match=r"preset: unknown run preset 'nope'; expected one of \[.*'smoke'"):
        load_config(preset="nope")


def test_an_unreachable_pushgateway_and_a_folder_that_is_no_policy_are_one_line_errors(tmp_path):
    """Both ended in a Python traceback."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for url, reason in ((f"http://127.0.0.1:{port}", "Connection refused"), ("localhost:9091", "unknown url type")):
        result = CliRunner().invoke(main, ["delete-metrics", "--pushgateway", url, "--pipeline", "p", "--run-id", "r"])
        assert result.exit_code == 1 and f"Error: pushgateway {url}: " in result.output and reason in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
    result = CliRunner().invoke(main, ["export", str(tmp_path), str(tmp_path / "out")])
    assert result.exit_code == 1 and f"Error: {tmp_path}/config.json does not exist: {tmp_path} is no policy" in (
        result.output
    )
    (tmp_path / "run.json").write_text("{}")  # a local run's folder, which holds its policies deeper down
    result = CliRunner().invoke(main, ["export", str(tmp_path), str(tmp_path / "out")])
    assert result.exit_code == 1 and f"Error: {tmp_path} is a tracefp4 run folder, not a policy (a train task's " in (
        result.output
    )
    # a server that answers JSON, but not a Pushgateway's (a KeyError traceback before)
    import http.server
    import threading

    class NotAGateway(http.server.BaseHTTPRequestHandler):
        answer = b'{"status": "ok"}'

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(self.answer)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotAGateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        result = CliRunner().invoke(main, ["delete-metrics", "--pushgateway", url, "--pipeline", "p", "--run-id", "r"])
        assert result.exit_code == 1 and "not a Pushgateway" in result.output
        # a Pushgateway's answer (its /api/v1/metrics) without the run: a name mistyped deletes nothing, and says so
        NotAGateway.answer = b'{"status": "success", "data": []}'
        result = CliRunner().invoke(main, ["delete-metrics", "--pushgateway", url, "--pipeline", "p", "--run-id", "r"])
        assert result.exit_code == 0 and "warning: no metrics group of job tracefp4, pipeline p, run r" in result.output
    finally:
        server.shutdown()


def test_set_puts_a_value_by_its_dotted_path_over_the_preset_and_is_refused_clearly(tmp_path):
    """--set KEY=VALUE: the value is YAML; a malformed pair, a value that is not YAML, a key the config lacks
    and a value of the wrong type each say what is wrong, before anything is written."""
    out = tmp_path / "p.yaml"
    args = ["compile", "--preset", "smoke", "--output", str(out)]
    result = CliRunner().invoke(main, [*args, "--set", "rl.rounds=3", "--set", "guidance.layers=[0, 1]"])
    assert result.exit_code == 0 and "14 tasks a run" in result.output  # 3 rounds
    assert '"rounds":3' in out.read_text() and '"layers":[0,1]' in out.read_text()
    out.unlink()
    for given, code, message in [
        ("rl.rounds", 2, "'rl.rounds': expected KEY=VALUE"),
        ("rl.rounds=[1", 2, "its value is not YAML (expected ',' or ']'"),
        ("rl={rounds: 3, rounds: 4}", 2, "its value is not YAML (key 'rounds' given twice (first at line 1))"),
        ("rl.roundz=3", 1, "rl.roundz: unknown field: did you mean rl.rounds?"),
        ("rl.rounds=two", 1, "rl.rounds: Input should be a valid integer"),
    ]:
        result = CliRunner().invoke(main, [*args, "--set", given])
        assert result.exit_code == code and message in result.output and not out.exists(), given


def test_sets_apply_in_the_order_given():
    """A --set of a list's item goes into the list an earlier --set gave; a key given again takes its
    new place in the order, as well as its new value."""
    mine = "[{name: mine, data: problems.jsonl, train_size: 16, test_size: 4}]"
    args = ["config", "--preset", "smoke", "--set", "tasks.0.train_size=20", "--set", f"tasks={mine}"]
    for more, size in [([], 16), (["--set", "tasks.0.train_size=30"], 30)]:
        result = CliRunner().invoke(main, [*args, *more])
        assert result.exit_code == 0, result.output
        assert [(t["name"], t["train_size"]) for t in yaml.safe_load(result.output)["tasks"]] == [("mine", size)]


def test_config_prints_the_whole_config_a_run_of_the_options_takes_and_it_reads_back(tmp_path):
    """A start for a --config file of one's own: every value, the checkpoint's in place of the preset's model."""
    args = ["config", "--preset", "tiny", "--set", "model.checkpoint=my-moe", "--set", "rl.rounds=2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.output)
    assert printed["model"]["checkpoint"] == "my-moe" and printed["model"]["preset"] is None
    assert printed["rl"]["rounds"] == 2 and printed["bootstrap"] and printed["tasks"]  # every section
    (tmp_path / "mine.yaml").write_text(result.output)
    expected = load_config(preset="tiny", overrides={"model.checkpoint": "my-moe", "rl.rounds": 2})
    assert load_config(tmp_path / "mine.yaml") == expected
    result = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "mine.json")])
    assert result.exit_code == 0 and load_config(tmp_path / "mine.json") == expected
    result = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "mine.toml")])
    assert result.exit_code == 1 and "--output" in result.output and "use .yaml, .yml or .json" in result.output
    result = CliRunner().invoke(main, ["config", "--set", "rl.rounds=two"])
    assert result.exit_code == 1 and "rl.rounds: Input should be a valid integer" in result.output
    # each task as what it is: a family without a file's settings, a file's benchmark without difficulty or weight
    tasks = '[{"name": "countdown"}, {"name": "bench", "data": "b.jsonl", "train_size": 0}]'
    result = CliRunner().invoke(main, ["config", "--set", f"tasks={tasks}", "--output", str(tmp_path / "t.yaml")])
    expected = load_config(preset="tiny", overrides={"tasks": yaml.safe_load(tasks)})
    assert result.exit_code == 0 and load_config(tmp_path / "t.yaml") == expected
    family, bench = yaml.safe_load((tmp_path / "t.yaml").read_text())["tasks"]
    assert list(family) == ["name", "difficulty", "train_size", "test_size", "weight"]
    file_fields = ["data", "sha256", "prompt_key", "answer_key", "prompt_template", "reward"]
    assert list(bench) == ["name", *file_fields, "train_size", "test_size"]


def test_a_request_timeout_and_a_run_folder_that_cannot_be_are_usage_errors(tmp_path):
    """Both ended in a traceback (urllib3's ValueError, NotADirectoryError)."""
    result = CliRunner().invoke(main, ["runs", "list", "--host", "http://localhost:1", "--timeout", "0"])
    assert result.exit_code == 2 and "--timeout': 0.0 is not in the range x>0" in result.output
    (tmp_path / "afile").write_text("x")
    result = CliRunner().invoke(main, ["run", "--preset", "smoke", "--output", str(tmp_path / "afile" / "sub")])
    assert result.exit_code == 1 and "afile/sub: Not a directory" in result.output  # a clean error


def test_a_run_refused_while_its_pipeline_is_built_says_only_why_and_makes_no_folder(tmp_path):
    """The header ('running ...') came first, and the folder was left holding its lock file."""
    args = ["run", "--preset", "smoke", "--set", "rollout.activation_global_scale=per_token"]
    result = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "run")])
    assert result.exit_code == 1 and result.output.startswith("Error: invalid tracefp4 config")
    assert "rollout.activation_global_scale: per_token cannot be exported" in result.output
    assert not (tmp_path / "run").exists()


def test_a_run_whose_tasks_cannot_be_drawn_or_scored_is_refused_before_the_pipeline_starts(tmp_path):
    """The configure task found it, and the run ended with that task's traceback."""
    for setting, message in [
        ("rollout.max_new_tokens=2", "rollout.max_new_tokens: 2 tokens cut answers such as"),
        ("tasks.0.train_size=100000", "tasks.0: "),
    ]:
        args = ["run", "--preset", "smoke", "--set", setting, "--output", str(tmp_path / "run")]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and result.output.startswith("Error: invalid tracefp4 config"), result.output
        assert message in result.output and "Traceback" not in result.output
        assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has the GPU the run asks for")
def test_a_run_on_a_gpu_this_machine_lacks_is_refused_before_any_step(tmp_path):
    """It failed in its first step, a traceback in the step's log."""
    args = ["run", "--preset", "smoke", "--set", "resources.device=cuda", "--output", str(tmp_path / "run")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and result.output.startswith("Error: invalid tracefp4 config")
    assert "resources.device: resources.device is 'cuda', but" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_a_ctrl_c_while_the_command_loads_ends_it_with_a_line_not_a_traceback(capsys, monkeypatch):
    """torch and kfp take a second or two to import; a Ctrl-C then (here raised
    by the import itself) ends the command with exit status 130 and one line."""
    import builtins

    import tracefp4.pipelines

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "tracefp4.pipelines.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    monkeypatch.setenv("PYTHONSAFEPATH", "")  # main sets it for the Pythons it starts: undone after the test
    with pytest.raises(SystemExit) as exited:
        tracefp4.pipelines.main()
    assert exited.value.code == 130
    assert capsys.readouterr().err == "tracefp4: interrupted while starting; nothing ran\n"


def test_the_command_started_in_the_checkouts_root_leaves_its_kernels_folder_off_sys_path():
    """``python -m tracefp4.pipelines`` (``make run``) in the checkout's root has
    the root first on sys.path, where the kernels/ folder shadows the `kernels`
    package transformers imports for its model code: the command drops it, and
    the Pythons it starts (kfp.local's components, torchrun's ranks) do not
    put their working directory there."""
    script = (
        "import os, subprocess, sys\n"
        "sys.argv = ['tracefp4', '--help']\n"
        "from tracefp4.pipelines import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import kernels\n"
        "child = 'import kernels; print(kernels.__file__)'\n"
        "print(kernels.__file__, subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ours, childs = (Path(path).resolve() for path in done.stdout.split()[-2:])
    assert ROOT / "kernels" not in (ours.parent, childs.parent)
    assert ours == childs  # the package transformers imports, in both


def test_compile_writes_a_yaml_file_whole_or_not_at_all(tmp_path):
    """Another name than .yaml ended in kfp's ValueError traceback, and a .json one left an empty file there;
    the pipeline is compiled aside and renamed into place, replacing an earlier one whole."""
    for name in ("p.json", "p.txt"):
        result = CliRunner().invoke(main, ["compile", "--preset", "smoke", "--output", str(tmp_path / name)])
        assert result.exit_code == 2 and "name a .yaml or .yml file" in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "p.yml"
    out.write_text("an earlier pipeline\n")
    result = CliRunner().invoke(main, ["compile", "--preset", "smoke", "--output", str(out)])
    assert result.exit_code == 0 and out.read_text().startswith("# PIPELINE DEFINITION"), result.output
    assert list(tmp_path.iterdir()) == [out]  # no temp file beside it


def test_schema_and_dashboards_into_a_folder_that_cannot_be_are_one_line_errors(tmp_path):
    """Both ended in a NotADirectoryError traceback."""
    (tmp_path / "afile").write_text("x")
    for command in ("schema", "dashboards"):
        result = CliRunner().invoke(main, [command, "--output", str(tmp_path / "afile" / "sub")])
        assert result.exit_code == 1 and result.output.startswith(f"Error: --output {tmp_path}/afile/sub: "), command
        assert "Not a directory" in result.output and isinstance(result.exception, SystemExit), command


def test_a_ca_bundle_and_skipping_verification_conflict(tmp_path):
    """With both, kfp.Client checked no certificate and the bundle went unread."""
    (tmp_path / "ca.pem").write_text("")
    args = ["--host", "https://127.0.0.1:9", "--ca-bundle", str(tmp_path / "ca.pem"), "--insecure-skip-verify"]
    for command in (["runs", "list"], ["runs", "status", "r"], ["submit", "--preset", "smoke"]):
        result = CliRunner().invoke(main, [*command, *args])
        assert result.exit_code == 2 and "--ca-bundle and --insecure-skip-verify: give one" in result.output, command


def test_runs_clean_refuses_all_with_only_store():
    """--all (the run's record among its KFP artifacts too) was ignored under --only store, which keeps them."""
    args = ["runs", "clean", "r", "--host", "http://127.0.0.1:9", "--only", "store", "--all", "--yes"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "--all and --only store: --all is about the KFP artifacts" in result.output


def test_version_names_the_installed_distribution():
    from importlib.metadata import version

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"tracefp4, version {version('tracefp4')}\n"


def test_an_option_and_a_set_of_its_field_that_disagree_are_refused(tmp_path):
    """--store won over --set store.uri=..., silently, whichever came last on the line."""
    result = CliRunner().invoke(
        main, ["compile", "--store", "s3://a/x", "--set", "store.uri=s3://b/y", "--output", str(tmp_path / "p.yaml")]
    )
    assert result.exit_code == 2 and "--store s3://a/x and --set store.uri=s3://b/y disagree" in result.output
    result = CliRunner().invoke(main, ["compile", "--pushgateway", "", "--output", str(tmp_path / "p.yaml")])
    assert result.exit_code == 1 and "metrics.pushgateway_url" in result.output  # an empty value is no value
    assert not (tmp_path / "p.yaml").exists()


def test_report_of_a_folder_that_is_no_run_folder_says_so(tmp_path):
    """A folder above the run folder (``runs`` for ``runs/tiny``) gave "no report its task finished writing", as
    if a run there had stopped short of its report."""
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 1 and f"{tmp_path}: not a run folder (no pipeline_root/ in it)" in result.output
    assert "--output of a `tracefp4 run`" in result.output


def test_report_says_whose_report_it_shows_and_takes_a_run_id(tmp_path, monkeypatch):
    """A folder of two runs' reports showed the newest, which a resumed older run had not written, without
    saying whose it was; kfp.local's task cache entries (completed/) name the finished reports."""
    import json

    entries = tmp_path / "completed"
    entries.mkdir()
    for i, run in enumerate(["local-aaa", "local-bbb"]):
        folder = tmp_path / "pipeline_root" / f"attempt-{i}" / "report"
        folder.mkdir(parents=True)
        for name in ("markdown", "page"):
            (folder / name).write_text(f"# report of {run} ({name})\n")
        (folder / "run.json").write_text(json.dumps({"run_id": run, "methods": None}))
        os.utime(folder / "markdown", (i, i))  # the second run's report the newer
        artifact = {"__kfp_artifact__": True, "uri": str(folder / "markdown")}
        (entries / f"{i}.json").write_text(json.dumps({"markdown": artifact}))
    shown = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert shown.exit_code == 0 and "# report of local-bbb (markdown)" in shown.output
    assert "the report of run local-bbb; the folder's other runs' (--run-id): local-aaa" in shown.output
    monkeypatch.chdir(tmp_path.parent)  # a relative run folder: its report's copies said as run says them, whole
    shown = CliRunner().invoke(main, ["report", tmp_path.name, "--run-id", "local-aaa"])
    assert shown.exit_code == 0 and "# report of local-aaa (markdown)" in shown.output
    assert f"report: {tmp_path / 'report.html'} (open it in a browser), {tmp_path / 'report.md'}" in shown.output
    assert (tmp_path / "report.html").read_text() == "# report of local-aaa (page)\n"
    # a reader that stops before the report's end (`| head`): the copies made all the same, with no warning that
    # blamed the copying for the closed pipe (the report was said first)
    for copy in ("report.html", "report.md"):
        (tmp_path / copy).unlink()
    command = [sys.executable, "-m", "tracefp4.pipelines.cli", "report", str(tmp_path)]
    closed = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    closed.stdout.close()
    assert "warning" not in closed.stderr.read() and closed.wait(timeout=60) == 1  # click's, for a closed pipe
    assert (tmp_path / "report.html").read_text() == "# report of local-bbb (page)\n"
    shown = CliRunner().invoke(main, ["report", str(tmp_path), "--run-id", "local-ccc"])
    assert shown.exit_code == 1 and "no finished report of run local-ccc; its runs' reports: local-aaa, local-bbb" in (
        shown.output
    )


def test_every_help_is_plain_text():
    """``tracefp4 --help`` showed the module docstring's reStructuredText (``tracefp4``) as it is."""

    def helps(command, words):
        yield words, command.get_help(click.Context(command, info_name=" ".join(words)))
        for name, sub in getattr(command, "commands", {}).items():
            yield from helps(sub, [*words, name])

    marked = [words for words, text in helps(main, ["tracefp4"]) if "``" in text or ":func:" in text]
    assert not marked, f"reStructuredText in the help of {marked}"


def test_bootstrap_and_export_write_their_folders_into_the_store(tmp_path, s3_env, monkeypatch):
    """An s3:// --output or DST: written here, then uploaded whole (a manifest last). Both had written a local
    folder named 's3:' and said the URI as if they had uploaded."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRACEFP4_CACHE_DIR", str(tmp_path / "cache"))
    prefix = f"models/{uuid.uuid4().hex[:8]}"
    base, exported = s3_env.uri(f"{prefix}/base"), s3_env.uri(f"{prefix}/exported")
    result = CliRunner().invoke(main, ["bootstrap", "--preset", "smoke", "--output", base])
    assert result.exit_code == 0 and f"\n{base}: 2 SFT steps" in result.output, result.output
    policy = fetch(base)  # checked against its manifest
    assert load_tokenizer(policy).files() == build_tokenizer().files() and load_model(policy).cfg.num_layers == 2
    result = CliRunner().invoke(main, ["export", str(policy), exported])
    assert result.exit_code == 0 and result.stdout.startswith(f"{exported}: nvfp4-pack-quantized"), result.output
    assert {"config.json", "checksums.json", "model.safetensors"} <= set(s3_env.store(f"{prefix}/exported").list())
    assert not (tmp_path / "s3:").exists()
    # a prefix that holds other objects: the upload would delete them
    s3_env.store(f"{prefix}/notes").put_bytes("readme.txt", b"mine")
    result = CliRunner().invoke(main, ["export", str(policy), s3_env.uri(f"{prefix}/notes")])
    assert result.exit_code == 1 and "holds 1 object(s) of no tracefp4 folder (readme.txt)" in result.output
    assert s3_env.store(f"{prefix}/notes").list() == ["readme.txt"]
    result = CliRunner().invoke(main, ["export", str(policy), base])  # nor a policy: a swapped or mistyped path
    assert result.exit_code == 1 and f"{base} holds a tracefp4 save that is no export" in result.output
    result = CliRunner().invoke(main, ["export", str(policy), exported])  # an export: replaced
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["bootstrap", "--preset", "smoke", "--output", exported])  # nor an export
    assert result.exit_code == 1 and "is no bootstrapped checkpoint (policy_version 0, format nvfp4" in result.output
    assert "bootstrap step" not in result.output  # refused before the work
    result = CliRunner().invoke(main, ["bootstrap", "--preset", "smoke", "--output", base])  # a bootstrap's: replaced
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["bootstrap", "--preset", "smoke", "--output", "s3://no-such-bucket-x/p"])
    assert result.exit_code == 1 and "bucket 'no-such-bucket-x' does not exist" in result.output
    assert "bootstrap step" not in result.output  # refused before the work
    # a folder of the user's files, or a prefix with objects in folders below (a run store's): refused before the
    # work (a local folder was refused only by the save, after the SFT; a prefix's folders below were not seen)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    s3_env.store(f"{prefix}/runs").put_bytes("smoke/run-1/history.jsonl", b"{}")
    for output, refusal in [
        (str(tmp_path / "mine"), "holds files tracefp4 did not save (it has no checksums.json)"),
        (s3_env.uri(f"{prefix}/runs"), "holds 1 object(s) of no tracefp4 folder (smoke/run-1/history.jsonl)"),
    ]:
        result = CliRunner().invoke(main, ["bootstrap", "--preset", "smoke", "--output", output])
        assert result.exit_code == 1 and refusal in result.output and "bootstrap step" not in result.output, output
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert s3_env.store(f"{prefix}/runs").list() == ["smoke/run-1/history.jsonl"]
