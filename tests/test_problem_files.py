"""A user's problems from a file (``tasks.i.data``): read as JSON Lines with
errors naming the line, drawn in a seeded order, rewarded by math-verify's
equivalence of the final answer, pinned by sha256 when a run starts so that a
file rewritten during the run stops it, and read from a path, a ``file://``
URI or an S3 store (a real SeaweedFS server, tests/s3_server.py)."""

import hashlib
import json
import time
from pathlib import Path

import pytest

from tracefp4.components import steps
from tracefp4.components.store import open_store
from tracefp4.components.tasks import MATH_TIMEOUT_S, FileTask, Problem, read_problems, reward_of, split
from tracefp4.pipelines import resume
from tracefp4.pipelines.local import run_to_end
from tracefp4.pipelines.parameters import pin_problems, reached
from tracefp4.schemas import ConfigError, RunConfig, get_preset, load_config

LINES = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(3)]


def _write(path, records=LINES) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _config(data: str, **task) -> RunConfig:
    """The smoke preset on the problems of ``data``, its store in a folder beside a local file."""
    config = get_preset("smoke").model_dump()
    config["tasks"] = [{"name": "sums", "data": data, "train_size": 8, "test_size": 4, **task}]
    if "://" not in data:
        config["store"]["uri"] = (Path(data).parent / "store").as_uri()
    return RunConfig.model_validate(config)


def test_a_file_is_read_as_problems_and_its_faults_name_their_line():
    text = b'{"prompt": "1+1=", "answer": 2, "source": "mine"}\n\n{"prompt": "x", "answer": "\\\\frac{1}{2}"}\n'
    assert read_problems("mine", text, "f.jsonl") == [
        Problem("mine", "1+1=", "2", {"line": 1}),
        Problem("mine", "x", "\\frac{1}{2}", {"line": 3}),
    ]
    assert len(read_problems("mine", text + b'{"prompt": "x", "answer": "\\\\frac{1}{2}"}\n', "f")) == 2  # a repeat
    faults = {
        b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="': "f.jsonl line 2: not a JSON object",
        b'["1+1=", "2"]': "line 1: a JSON list, not an object with 'prompt' and 'answer'",
        b'{"question": "1+1=", "answer": 2}': "line 1: no 'prompt' (keys: question, answer)",
        b'{"prompt": "1+1="}': "line 1: no 'answer' (keys: prompt)",
        b'{"prompt": "", "answer": 2}': "line 1: 'prompt' must be a non-empty string, got ''",
        b'{"prompt": "1+1=", "answer": true}': "line 1: 'answer' must be a non-empty string or a number, got True",
        b'{"prompt": "a", "answer": 1}\n{"prompt": "a", "answer": 2}': "line 2: the prompt of line 1 again, with "
        "answer '2' where it had '1'",
        b"\n  \n": "f.jsonl: no problems in it",
        b'{"prompt": "\xff"}': "f.jsonl: not UTF-8 text",
    }
    for data, message in faults.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            read_problems("mine", data, "f.jsonl")


def test_a_response_scores_when_its_final_answer_equals_the_reference_mathematically():
    def score(answer, response, finished=True):
        return reward_of(Problem("mine", "q", answer, {"line": 1}), response, finished)

    assert score("42", "42") == score("42", "The answer is \\boxed{42}.") == 1.0
    assert score("42", "<think>maybe 41? no</think>\n\nSo it is $\\boxed{42}$.") == 1.0  # after the thinking
    assert score("\\frac{1}{2}", "0.5") == score("x+1", "\\boxed{1+x}") == 1.0
    assert score("42", "\\boxed{41}") == score("42", "<think>it is 42") == score("42", "no idea") == 0.0
    assert score("42", "") == score("42", "\\boxed{") == 0.0
    # a power tower that sympy would work on for long: interrupted after MATH_TIMEOUT_S, scored 0
    start = time.monotonic()
    assert score("42", "9^9^9^9^9") == 0.0 and time.monotonic() - start < 10 * MATH_TIMEOUT_S
    # cut by the length limit: its last line may be an answer cut short (357 of 3579), so it does not count
    assert score("357", "the answer is 357", finished=False) == 0.0
    assert score("357", "the answer is 357\n", finished=False) == 1.0


def test_a_file_task_draws_distinct_problems_in_a_seeded_order():
    task = FileTask("sums", read_problems("sums", "".join(json.dumps(r) + "\n" for r in LINES).encode(), "f"), "f")
    train, test = split(task, 20, 5, seed=3, difficulty=1)
    assert len({p.prompt for p in train + test}) == 25 and split(task, 20, 5, seed=3, difficulty=1) == (train, test)
    assert split(task, 20, 5, seed=4, difficulty=1) != (train, test)
    assert not {p.prompt for p in task.generate(10, 0, 1, frozenset(p.prompt for p in test))} & {p.prompt for p in test}
    with pytest.raises(ValueError, match="f holds 30 distinct problems, not 31"):
        task.generate(31, 0, 1)


def test_the_config_keeps_file_tasks_and_generated_families_apart():
    def problems(**task):
        with pytest.raises(ConfigError) as e:
            load_config(None, preset="smoke", overrides={"tasks": [task]})
        return str(e.value)

    assert "'gsm8k' is no generated task family (arithmetic, countdown, program); to read problems from a file, " in (
        problems(name="gsm8k")
    )
    assert "'countdown' is a generated family's" in problems(name="countdown", data="c.jsonl")
    assert "difficulty: 3 is a generated family's knob" in problems(name="mine", data="m.jsonl", difficulty=3)
    assert "sha256: is the digest of data's file; this task has no data" in problems(name="countdown", sha256="0" * 64)
    assert "tasks.0.name: must be a task name: lowercase letters" in problems(name="My Task", data="m.jsonl")
    assert "tasks.0.sha256: must be a sha256 digest" in problems(name="mine", data="m.jsonl", sha256="abc")
    assert "tasks.0.data: must start with file://, s3:// or minio://" in problems(
        name="mine", data="https://host/x.jsonl"
    )


def test_a_run_pins_its_files_and_a_file_rewritten_during_it_stops_the_next_step(tmp_path):
    data = _write(tmp_path / "sums.jsonl")
    config = _config(data)
    pinned = pin_problems(config)
    assert pinned.tasks[0].sha256 == hashlib.sha256((tmp_path / "sums.jsonl").read_bytes()).hexdigest()
    assert steps.problems(pinned) == steps.problems(config)
    assert {p.task for p in steps.problems(pinned)[0]} == {"sums"}
    # the run's first task returns the pinned config, which every later task reads
    assert RunConfig.model_validate_json(reached(config.model_dump_json())) == pinned
    _write(tmp_path / "sums.jsonl", LINES[:-1])
    assert len(steps.task_of(config, 0).problems) == len(LINES) - 1  # read anew, not kept from before
    with pytest.raises(ValueError, match=f"tasks.0.data: {data} has changed since the run started: its sha256 is"):
        steps.problems(pinned)
    # a local run given the rewritten file is another run (its request holds the config, pinned when it starts)
    store = open_store((tmp_path / "store").as_uri())
    assert resume.request(pin_problems(config), None, store) != resume.request(pinned, None, store)
    # a pinned one that does not match is refused when the run starts too, as is a file that is not there
    with pytest.raises(ConfigError, match="tasks.0.data: .* has changed since the run started"):
        pin_problems(pinned)
    with pytest.raises(ConfigError, match=f"tasks.0.data: {tmp_path}/none.jsonl: no such file"):
        pin_problems(_config(str(tmp_path / "none.jsonl")))
    # as file:// too
    assert pin_problems(_config((tmp_path / "sums.jsonl").as_uri())).tasks[0].sha256 != pinned.tasks[0].sha256


def test_the_first_task_refuses_a_file_too_small_or_with_an_answer_no_response_could_match(tmp_path):
    with pytest.raises(ConfigError, match="tasks.0: train_size 40 \\+ test_size 4: .*sums.jsonl holds 30 distinct"):
        reached(_config(_write(tmp_path / "sums.jsonl"), train_size=40).model_dump_json())
    # a library preset's character tokenizer would read it as <unk>
    records = [*LINES[:11], {"prompt": "2\u00d73=", "answer": 6}]
    with pytest.raises(ConfigError, match="tasks.0.data: .*chars.jsonl line 12: '\u00d7' is outside"):
        reached(_config(_write(tmp_path / "chars.jsonl", records)).model_dump_json())
    records = [*LINES, {"prompt": "say hi", "answer": "\\boxed{"}]  # not drawn by a split of 12: checked too
    with pytest.raises(ConfigError, match=r"tasks.0.data: .*bad.jsonl line 31: answer '\\\\boxed\{' is no math"):
        reached(_config(_write(tmp_path / "bad.jsonl", records)).model_dump_json())


def test_a_file_in_an_s3_store_is_read_with_the_run_stores_settings(s3_env, tmp_path):
    local = _write(tmp_path / "sums.jsonl")
    open_store(s3_env.uri("data")).upload("sums.jsonl", local)
    task = {"name": "sums", "data": s3_env.uri("data/sums.jsonl"), "train_size": 8, "test_size": 4}
    config = load_config(None, preset="smoke", overrides={"store.uri": s3_env.uri("runs"), "tasks": [task]})
    assert pin_problems(config).tasks[0].sha256 == pin_problems(_config(local)).tasks[0].sha256
    assert steps.problems(config) == steps.problems(_config(local))
    missing = load_config(None, preset="smoke", overrides={"tasks": [{**task, "data": s3_env.uri("data/none.jsonl")}]})
    with pytest.raises(ConfigError, match=r"tasks.0.data: s3://.*/data/none.jsonl: no such file"):
        pin_problems(missing)


def test_a_local_run_trains_and_evaluates_on_a_files_problems(tmp_path):
    finished = run_to_end(_config(_write(tmp_path / "sums.jsonl")), tmp_path / "run", out=open(tmp_path / "out", "w"))
    report, data = finished.report.read_text(), tmp_path / "sums.jsonl"
    sha256 = hashlib.sha256(data.read_bytes()).hexdigest()
    assert f"tasks: sums (`{data}`, sha256 {sha256[:12]})." in report  # the pinned file's
    assert "| sums pass@1 |" in report and "| bf16 | sums | trained | initial |" in report
