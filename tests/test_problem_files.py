"""A user's problems from a file (``tasks.i.data``): read as JSON Lines with
errors naming the line, drawn in a seeded order, rewarded by math-verify's
equivalence of the final answer, pinned by sha256 when a run starts so that a
file rewritten during the run stops it, and read from a path, a ``file://``
URI or an S3 store (a real SeaweedFS server, tests/s3_server.py)."""

import hashlib
import json
import logging
import re
import signal
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tracefp4.components import steps
from tracefp4.components.rollout import Trajectory
from tracefp4.components.store import open_store
from tracefp4.components.tasks import (
    MATH_TIMEOUT_S,
    FileTask,
    LineFormat,
    Problem,
    _math_verify,
    read_problems,
    reward_of,
    split,
)
from tracefp4.pipelines import resume
from tracefp4.pipelines.local import run_to_end
from tracefp4.pipelines.parameters import pin_problems, reached
from tracefp4.schemas import ConfigError, RunConfig, get_preset, load_config

LINES = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(3)]
BENCH = [{"prompt": f"{a}*{b}=", "answer": a * b} for a in range(4) for b in range(2)]


def _write(path, records=LINES) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# a reward of a user's own: full marks for the answer, half for another of the line's choices; each call noted
REWARD = """
import os

def score(response, answer, line):
    with open(os.path.join(os.path.dirname(__file__), "calls.txt"), "a") as f:
        f.write(line["prompt"] + "\\n")
    said = response.strip()
    return 1 if said == answer else 0.5 * (said in map(str, line.get("choices", [])))
"""


def _config(data: str, *others: dict, **task) -> RunConfig:
    """The smoke preset on the problems of ``data`` (and the tasks ``others``), its store in a folder beside a
    local file."""
    config = get_preset("smoke").model_dump()
    config["tasks"] = [{"name": "sums", "data": data, "train_size": 8, "test_size": 4, **task}, *others]
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
        b'["1+1=", "2"]': "line 1: a list, not an object with 'prompt' and 'answer'",
        b'{"question": "1+1=", "answer": 2}': "line 1: no 'prompt' (keys: question, answer)",
        b'{"prompt": "1+1="}': "line 1: no 'answer' (keys: prompt)",
        b'{"prompt": "", "answer": 2}': "line 1: 'prompt' must be a non-empty string, got \"\"",
        b'{"prompt": "1+1=", "answer": true}': "line 1: 'answer' must be a non-empty string or a number, got true",
        b'{"prompt": "0/0=", "answer": NaN}': "line 1: 'answer' must be a finite number, got nan",  # math-verify: a*n*n
        b'{"prompt": "1/0=", "answer": -Infinity}': "line 1: 'answer' must be a finite number, got -inf",
        b'{"prompt": "a", "answer": 1}\n{"prompt": "a", "answer": 2}': "line 2: the prompt of line 1 again, with "
        "answer '2' where it had '1'",
        b"\n  \n": "f.jsonl: no problems in it",
        b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "\xff"}': "f.jsonl line 2: not UTF-8 text (invalid start byte at "
        "byte 44 of the file)",
    }
    for data, message in faults.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            read_problems("mine", data, "f.jsonl")


def test_a_files_keys_and_prompt_template_are_the_tasks_own():
    line = {"id": 7, "problem": "1+1=", "reward_model": {"style": "rule", "ground_truth": "2"}, "long": [0] * 99}
    fmt = LineFormat("problem", "reward_model.ground_truth", "{prompt} Put it in \\boxed{}.")
    assert read_problems("mine", json.dumps(line).encode(), "f", fmt) == [
        Problem("mine", "1+1= Put it in \\boxed{}.", "2", {"line": 1, "prompt": "1+1="})
    ]
    faults = {
        LineFormat("question"): "f line 1: no 'question' (keys: id, problem, reward_model, long)",
        LineFormat("problem", "reward_model.answer"): "f line 1: no 'reward_model.answer' (keys of reward_model: "
        "style, ground_truth)",
        LineFormat("problem", "id.x"): "f line 1: no 'id.x' (id is a number)",
        LineFormat("id", "problem"): "f line 1: 'id' must be a non-empty string, got 7",
        LineFormat(
            "reward_model", "problem"
        ): 'f line 1: \'reward_model\' must be a non-empty string, got {"style": "rule", "ground_truth": "2"} (set '
        "prompt_key to the key of the question's text)",
        LineFormat(
            "problem", "long"
        ): f"f line 1: 'long' must be a non-empty string or a number, got [{'0, ' * 25}0...",
    }
    for fmt, message in faults.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            read_problems("mine", json.dumps(line).encode(), "f", fmt)
    bom = b"\xef\xbb\xbf" + json.dumps(line).encode()  # a byte order mark first, as Windows tools write
    assert read_problems("mine", bom, "f", LineFormat("problem", "reward_model.ground_truth"))[0].answer == "2"
    # verl's layout: the prompt a list of chat messages, reached by item number
    verl = {"prompt": [{"role": "user", "content": "1+2="}], "reward_model": {"ground_truth": "3"}}
    fmt = LineFormat("prompt.0.content", "reward_model.ground_truth")
    assert [(p.prompt, p.answer) for p in read_problems("mine", json.dumps(verl).encode(), "f", fmt)] == [("1+2=", "3")]
    for fmt, message in {
        LineFormat("prompt.1.content"): "f line 1: no 'prompt.1.content' (prompt holds 1 item(s), from 0)",
        LineFormat("prompt.content"): "f line 1: no 'prompt.content' (prompt is a list: name an item by its number, "
        "such as prompt.0)",
    }.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            read_problems("mine", json.dumps(verl).encode(), "f", fmt)

    def problems(**task):
        with pytest.raises(ConfigError) as e:
            load_config(None, preset="smoke", overrides={"tasks": [task]})
        return str(e.value)

    assert "tasks.0.prompt_key: reads data's lines; this task has no data" in problems(name="countdown", prompt_key="q")
    assert "tasks.0.prompt_template: 'Solve: {prompt} {prompt}' must hold {prompt} once" in problems(
        name="mine", data="m.jsonl", prompt_template="Solve: {prompt} {prompt}"
    )
    assert "tasks.0.answer_key: must be a JSON key, or keys and list item numbers joined by '.'" in problems(
        name="mine", data="m.jsonl", answer_key="reward_model."
    )
    assert "tasks.0.answer_key: 'q' is prompt_key too" in problems(
        name="mine", data="m", prompt_key="q", answer_key="q"
    )
    for name in ("all", "avg"):  # the training mix's metrics label, the report's averages
        assert f"tasks.0.name: '{name}' names all the tasks at once" in problems(name=name, data="m.jsonl")
    assert "tasks.0.prompt_template: '' must hold {prompt} once" in problems(name="m", data="m", prompt_template="")
    # YAML's readings of an unquoted {prompt} and of a \b in double quotes
    assert "tasks.0.prompt_template: a mapping, {'prompt': None}: quote the template" in problems(
        name="m", data="m", prompt_template={"prompt": None}
    )
    assert "tasks.0.prompt_template: holds the control character '\\x08' (in YAML's double quotes" in problems(
        name="m", data="m", prompt_template="{prompt} in \boxed{}"
    )
    # and of \text and \neq there: a tab and a newline, which a template may hold elsewhere
    assert "holds a tab before 'ext' (in YAML's double quotes \\t is a tab: write \\\\text, or" in problems(
        name="m", data="m", prompt_template="{prompt} as \text{yes} or \text{no}"
    )
    assert "holds a newline before 'eq' (in YAML's double quotes \\n is a newline: write \\\\neq" in problems(
        name="m", data="m", prompt_template="{prompt} where x \neq 0"
    )
    task = {"name": "m", "data": "m", "prompt_template": "Question:\n{prompt}\tAnswer:\neach line"}
    assert load_config(None, preset="smoke", overrides={"tasks": [task]}).tasks[0].prompt_template.startswith("Q")


def test_a_templates_own_characters_and_its_bare_prompts_are_checked_as_its_own(tmp_path):
    """On a library preset a character of the template is named as the template's, not a line's; the check
    across tasks compares a file's prompts as its lines hold them, so a benchmark put in another template is
    still the problem trained on."""
    sums = {"name": "sums", "data": _write(tmp_path / "sums.jsonl"), "train_size": 30, "test_size": 0}
    config = load_config(
        None,
        preset="smoke",
        overrides={"tasks": [{**sums, "test_size": 4, "train_size": 8, "prompt_template": "{prompt} \u00d7"}]},
    )
    with pytest.raises(ConfigError, match="tasks.0.prompt_template: '\u00d7' is outside the library preset's"):
        reached(config.model_dump_json())
    again = {**sums, "name": "again", "train_size": 0, "test_size": 4, "prompt_template": "Q: {prompt}\nA:"}
    config = load_config(None, preset="smoke", overrides={"tasks": [sums, again]})
    with pytest.raises(ConfigError, match=r"tasks.1: 4 of again's 4 test prompts .*: drop them from \S*sums.jsonl$"):
        reached(config.model_dump_json())


def test_a_response_scores_when_its_final_answer_equals_the_reference_mathematically():
    def score(answer, response, finished=True):
        return reward_of(Problem("mine", "q", answer, {"line": 1}), response, finished)

    assert score("42", "42") == score("42", "The answer is \\boxed{42}.") == 1.0
    assert score("42", "<think>maybe 41? no</think>\n\nSo it is $\\boxed{42}$.") == 1.0  # after the thinking
    assert score("\\frac{1}{2}", "0.5") == score("x+1", "\\boxed{1+x}") == 1.0
    assert score("42", "\\boxed{41}") == score("42", "<think>it is 42") == score("42", "no idea") == 0.0
    # an answer alone (as bootstrap teaches) is read as the reference is, inside a \boxed{}: math-verify reads
    # undelimited text as numbers alone, x+1 as nothing and 2^{10} as 2
    for answer in ("x+1", "x^2+1", "\\sqrt{2}", "2\\pi", "B", "(1, 2]"):
        assert score(answer, answer) == 1.0, answer
    assert score("x+1", "1+x") == score("1024", "2^{10}") == score("(1,2]", "(1, 2].") == 1.0
    assert score("2", "2^{10}") == score("3", "3\\sqrt{2}") == score("12", "12x+5") == score("1", "1+x") == 0.0
    assert score("42", "") == score("42", "\\boxed{") == 0.0
    # a power tower that sympy would work on for long: interrupted after MATH_TIMEOUT_S, scored 0
    start = time.monotonic()
    assert score("42", "9^9^9^9^9") == 0.0 and time.monotonic() - start < 10 * MATH_TIMEOUT_S
    # cut by the length limit: its last line may be an answer cut short (357 of 3579), so it does not count
    assert score("357", "the answer is 357", finished=False) == 0.0
    assert score("357", "the answer is 357\n", finished=False) == 1.0


def test_math_verify_warns_of_a_parsing_timeout_without_the_whole_response(caplog):
    _math_verify()  # imported, its parser's log filtered
    with caplog.at_level(logging.WARNING, logger="math_verify.parser"):
        logging.getLogger("math_verify.parser").warning(f"Timeout during parsing: {'x' * 5000}")
    (record,) = caplog.records
    assert record.getMessage() == f"Timeout during parsing: {'x' * 176}... (5024 characters)"


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


def test_a_task_is_trained_on_alone_or_evaluated_on_alone_and_never_both_across_tasks(tmp_path):
    def problems(tasks, **settings):
        with pytest.raises(ConfigError) as e:
            load_config(None, preset="smoke", overrides={"tasks": tasks, **settings})
        return str(e.value)

    sums = {"name": "sums", "data": _write(tmp_path / "sums.jsonl"), "train_size": 20, "test_size": 0}
    bench = {"name": "bench", "data": _write(tmp_path / "bench.jsonl", BENCH), "train_size": 0, "test_size": 8}
    assert "tasks.0.train_size: 0 and test_size 0: the task is neither" in problems([{**sums, "train_size": 0}])
    assert "tasks.1.weight: 2.0, but the task has no training prompts" in problems([sums, {**bench, "weight": 2}])
    assert "tasks: every task's train_size is 0: nothing to train on" in problems([bench])
    assert "tasks: every task's test_size is 0: nothing to evaluate on" in problems([sums])
    assert "tasks.1.test_size: 8 held-out bench prompts, but evaluation.test_prompts 12 asks 12 of each of the 1 " in (
        problems([sums, bench], **{"evaluation.test_prompts": 12})
    )
    checks = {"bootstrap.eval_every": 1, "bootstrap.eval_prompts": 3, "evaluation.test_prompts": 8}
    config = load_config(None, preset="smoke", overrides={"tasks": [bench, sums, {**sums, "name": "more"}], **checks})
    assert (config.test_shares, config.bootstrap_checks) == ([8, 0, 0], [0, 2, 1])  # of the tested; of the trained
    whole = {"tasks": [sums, bench, {**bench, "name": "half", "test_size": 4}], "evaluation.test_prompts": 0}
    assert load_config(None, preset="smoke", overrides=whole).test_shares == [0, 8, 4]  # each test split whole
    train, test = steps.problems(config)
    assert {p.task for p in train} == {"sums", "more"} and {p.task for p in test} == {"bench"} and len(test) == 8
    assert {p.task for p in steps.training_problems(config, 0, 64)} == {"sums", "more"}
    assert {p.task for p in steps.sft_problems(config)[1]} == {"sums", "more"}  # the checks: training problems
    # a benchmark's problem in the training file: refused before any work, naming both lines
    leaked = {**bench, "data": _write(tmp_path / "leaked.jsonl", [*BENCH[:7], LINES[4]])}
    config = load_config(None, preset="smoke", overrides={"tasks": [{**sums, "train_size": 30}, leaked]})
    with pytest.raises(
        ConfigError, match=r"tasks.1: 1 of bench's 8 test prompts is another task's training prompt, so "
    ):
        reached(config.model_dump_json())
    with pytest.raises(
        ConfigError, match=r"leaked.jsonl line 8, is one of tasks.0 \(sums's, .*sums.jsonl line 5\): drop "
    ):
        reached(config.model_dump_json())
    # a generated family's problems count too: arithmetic's products are the benchmark's
    arithmetic = {"name": "arithmetic", "train_size": 290, "test_size": 0}
    config = load_config(None, preset="smoke", overrides={"tasks": [arithmetic, bench]})
    with pytest.raises(
        ConfigError,
        match=r"tasks.1: 8 of bench's 8 test prompts are other tasks' training prompts "
        r"\(lines 1, 2, 3, 4, 5, 6, 7, 8\), .*; "
        r"the first, .*bench.jsonl line \d, is one of tasks.0 \(a problem of arithmetic\): drop them "
        r"from .*bench.jsonl$",
    ):
        reached(config.model_dump_json())


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
    with pytest.raises(ConfigError, match=f"tasks.0.data: {tmp_path}/none.jsonl: no such file$"):
        pin_problems(_config(str(tmp_path / "none.jsonl")))
    with pytest.raises(
        ConfigError, match=re.escape(f"none.jsonl: no such file (a relative path, read from {Path.cwd()})")
    ):
        pin_problems(load_config(None, preset="smoke", overrides={"tasks": [{"name": "sums", "data": "none.jsonl"}]}))
    with pytest.raises(
        ConfigError, match=r"~/none.jsonl: no such file \(a relative path, read from .*\) \(~ is no home"
    ):
        pin_problems(load_config(None, preset="smoke", overrides={"tasks": [{"name": "sums", "data": "~/none.jsonl"}]}))
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


def test_config_check_reads_the_files_as_the_first_task_does(tmp_path):
    """Before a submit: the files' faults and the draws' are found here, and a good config comes back pinned."""
    from click.testing import CliRunner

    from tracefp4.pipelines.cli import main

    data = _write(tmp_path / "sums.jsonl")
    task = f'tasks=[{{"name": "sums", "data": "{data}", "train_size": 8, "test_size": 4}}]'
    result = CliRunner().invoke(main, ["config", "--preset", "smoke", "--set", task, "--check"])
    assert result.exit_code == 0 and f"sha256: {hashlib.sha256(Path(data).read_bytes()).hexdigest()}" in result.output
    result = CliRunner().invoke(
        main, ["config", "--preset", "smoke", "--set", task.replace('": 8', '": 40'), "--check"]
    )
    assert result.exit_code == 1 and "tasks.0: train_size 40 + test_size 4: " in result.output
    assert "holds 30 distinct problems, not 44" in result.output
    bare = f'tasks=[{{"name": "sums", "data": "{data}"}}]'  # sizes a user never set: said to be the defaults
    result = CliRunner().invoke(main, ["config", "--preset", "smoke", "--set", bare, "--check"])
    assert "tasks.0: train_size 256 + test_size 32 (the schema's defaults): " in result.output, result.output
    # what a reward prints as it is checked goes to standard error: the config printed is a file's
    (tmp_path / "rewards.py").write_text(
        "def score(response, answer, line):\n    print('scoring', response)\n    return 1\n"
    )
    rewarded = task.replace('"test_size": 4', f'"test_size": 4, "reward": "{tmp_path}/rewards.py:score"')
    result = CliRunner().invoke(main, ["config", "--preset", "smoke", "--set", rewarded, "--check"])
    assert result.exit_code == 0 and "scoring 0" in result.stderr and "scoring" not in result.stdout
    assert yaml.safe_load(result.stdout)["tasks"][0]["reward_sha256"]
    # a --config file's fault is named with the file, as validation's are, and with a --set beside it
    run_file = tmp_path / "run.yaml"
    run_file.write_text(f"tasks: [{{name: sums, data: {tmp_path}/none.jsonl}}]\n")
    result = CliRunner().invoke(main, ["config", "--config", str(run_file), "--check"])
    assert result.exit_code == 1 and f"invalid tracefp4 config in {run_file} (1 problem):" in result.output
    result = CliRunner().invoke(main, ["config", "--config", str(run_file), "--set", "seed=1", "--check"])
    assert f"in {run_file} with the overrides (1 problem):\n  tasks.0.data: {tmp_path}/none.jsonl: no such" in (
        result.output
    )


def test_a_reward_of_the_users_own_scores_a_files_problems_wherever_they_are_read(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARD)
    records = [{**r, "choices": [r["answer"], r["answer"] + 1]} for r in LINES]
    config = _config(_write(tmp_path / "sums.jsonl", records), reward=f"{tmp_path}/rewards.py:score")
    pinned = pin_problems(config)
    assert pinned.tasks[0].reward_sha256 == hashlib.sha256((tmp_path / "rewards.py").read_bytes()).hexdigest()
    problem = next(p for p in steps.problems(pinned)[0] if p.answer == "5")
    assert [reward_of(problem, said, finished=True) for said in ("5", "6", "7")] == [1.0, 0.5, 0.0]
    assert reward_of(problem, "5", finished=False) == 0.0  # cut by the length limit: up to its last whole line
    # the train step reads its problems from the rollout's trajectories file, which holds no function
    line = json.loads(steps.trajectory_line(Trajectory(0, [1], [2], [0.0], "stop"), problem))
    read = Problem(**line["problem"])
    assert read == problem and read.reward is None and line["problem"]["meta"]["record"]["choices"] == [5, 6]
    with pytest.raises(
        ValueError, match=rf"a problem of task sums \(line {problem.meta['line']}\) lacks its reward function"
    ):
        reward_of(read, "5", finished=True)
    assert reward_of(steps.with_rewards(pinned, [read])[0], "6", finished=True) == 0.5
    # the first problem once, before the run (given its own answer), then every score above
    assert (tmp_path / "calls.txt").read_text().splitlines() == ["0+0=", *[problem.prompt] * 5]
    # a reward file rewritten during the run stops the next step, as a problem file does
    (tmp_path / "rewards.py").write_text(REWARD.replace("0.5", "0.25"))
    with pytest.raises(ValueError, match="tasks.0.reward: .*rewards.py has changed since the run started"):
        steps.with_rewards(pinned, [read])
    # the sha256's check fails a step, the sha256 alone has no place without a reward
    with pytest.raises(ValidationError, match="reward_sha256: is the digest of reward's file"):
        _config(_write(tmp_path / "sums.jsonl"), reward_sha256="0" * 64)


def test_accuracy_counts_a_response_solved_at_reward_1_alone(tmp_path):
    """A partial reward is RL's, not accuracy's: pass@1 stays a share of prompts solved, as its interval needs."""
    from tracefp4.components.bootstrap import accuracy
    from tracefp4.components.model import build_model
    from tracefp4.components.tokenizer import build_tokenizer

    data = _write(tmp_path / "sums.jsonl")
    for value, share in (("0.5", 0.0), ("True", 1.0)):
        (tmp_path / "rewards.py").write_text(f"def score(response, answer, line):\n    return {value}\n")
        test = steps.problems(_config(data, reward=f"{tmp_path}/rewards.py:score"))[1]
        assert accuracy(build_model("smoke", seed=0), build_tokenizer(), test, max_new_tokens=2) == share


def test_a_reward_that_cannot_score_is_refused_before_the_run_naming_what_is_wrong(tmp_path, caplog):
    data = _write(tmp_path / "sums.jsonl")
    faults = {
        "def score(response, answer, line)\n": "rewards.py line 1: expected ':'",
        "import helpers\n": "rewards.py: running it raised ModuleNotFoundError: No module named 'helpers' (at line 1: "
        "import helpers) (a module beside the reward file is not importable: put its code in the file",
        "def other(response, answer, line):\n    return 1\n": "defines no function 'score' (its functions: other)",
        "score = 3\n": "defines no function 'score' (its functions: none)",
        "def score(response):\n    return 1\n": "rewards.py:score cannot be called as score(response, answer, line)",
        "def score(response, answer, line):\n    return line['tests']\n": (
            f"rewards.py:score on {data} line 1: raised KeyError: 'tests' (at line 2: return line['tests']); the "
            'response: "0" (given the line\'s answer as the response'
        ),
        "import json\n\nsettings = json.loads('{')\n": "rewards.py: running it raised JSONDecodeError: Expecting "
        "property name enclosed in double quotes: line 1 column 2 (char 1) (at line 3: settings = json.loads('{'))",
        "def score(response, answer, line):\n    return 2\n": f"rewards.py:score on {data} line 1: returned 2, not a",
        "def score(response, answer, line):\n    return 'yes'\n": "returned 'yes', not a number from 0 to 1",
        # sys.exit would end the step without a word, with exit status 0 for sys.exit(0)
        "import sys\n\nsys.exit(0)\n": "rewards.py: running it raised SystemExit: 0 (at line 3: sys.exit(0))",
        "import sys\n\ndef score(response, answer, line):\n    sys.exit(3)\n": (
            f'rewards.py:score on {data} line 1: raised SystemExit: 3 (at line 4: sys.exit(3)); the response: "0"'
        ),
    }
    for code, fault in faults.items():
        (tmp_path / "rewards.py").write_text(code)
        with pytest.raises(ConfigError, match=f"tasks.0.reward: {tmp_path}/" * (":" in fault[:12]) + re.escape(fault)):
            pin_problems(_config(data, reward=f"{tmp_path}/rewards.py:score"))
    (tmp_path / "rewards.py").write_text(
        "import numpy\n\ndef score(response, answer, line):\n    return numpy.int64(1)\n"
    )
    assert (
        pin_problems(_config(data, reward=f"{tmp_path}/rewards.py:score")).tasks[0].reward_sha256
    )  # numpy's: a number
    # one that scores the line's own answer below 1 runs, warned of: it may want a form, or take other arguments
    (tmp_path / "rewards.py").write_text("def score(data_source, solution_str, ground_truth):\n    return 0\n")
    with caplog.at_level(logging.WARNING, logger="tracefp4"):
        pin_problems(_config(data, reward=f"{tmp_path}/rewards.py:score"))
    assert f"rewards.py:score scores {data} line 1 0 given the line's own answer as the response" in caplog.text
    assert "it is called as score(response, answer, line)" in caplog.text
    with pytest.raises(ConfigError, match=f"tasks.0.reward: {tmp_path}/none.py: no such file"):
        pin_problems(_config(data, reward=f"{tmp_path}/none.py:score"))
    mistakes = {
        "rewards.py": "must be a Python file and a function in it, FILE.py:FUNCTION",
        "rewards.py:9score": "must be a Python file and a function in it",
        "gs://bucket/rewards.py:score": "must start with file://, s3:// or minio://",
    }
    for reward, fault in mistakes.items():
        with pytest.raises(ConfigError, match=re.escape(f"tasks.0.reward: {fault}")):
            load_config(None, preset="smoke", overrides={"tasks": [{"name": "sums", "data": data, "reward": reward}]})
    with pytest.raises(
        ValidationError, match=r"reward: scores data's problems \(a family scores its own\); this task has no data"
    ):
        RunConfig.model_validate({"tasks": [{"name": "arithmetic", "reward": "rewards.py:score"}]})


def test_a_reward_call_that_runs_past_its_time_limit_stops_naming_where_it_was(tmp_path):
    """A function that never returns would hold the step, and a cluster's GPUs, without a word. The limit
    interrupts a wait (a sleep, a subprocess's), a loop that takes every Exception for its own fault, and one
    that math-verify's own time limit (SIGALRM's handler for a while, then the alarm cancelled) ran inside."""
    data = _write(tmp_path / "sums.jsonl")
    hangs = {
        "import time\n\ndef score(response, answer, line):\n    time.sleep(60)\n": r"at line 4: time\.sleep\(60\)",
        "def score(response, answer, line):\n    while True:\n        try:\n            pass\n"
        "        except Exception:\n            pass\n": "at line ",
        "import math_verify\n\ndef score(response, answer, line):\n    math_verify.verify(math_verify.parse('1'), "
        "math_verify.parse('1'))\n    while True:\n        pass\n": "at line [56]: ",  # past its call
    }
    previous = signal.getsignal(signal.SIGALRM)
    for code, at in hangs.items():
        (tmp_path / "rewards.py").write_text(code)
        config = _config(data, reward=f"{tmp_path}/rewards.py:score", reward_timeout_s=0.5)
        start = time.monotonic()
        with pytest.raises(ConfigError, match=rf"line 1: ran longer than 0\.5 s, the task's reward_timeout_s \({at}"):
            pin_problems(config)
        assert time.monotonic() - start < 10
        assert signal.getsignal(signal.SIGALRM) is previous  # the step's own handler back
    # a call within its limit is not disturbed, and the limit is the task's alone
    (tmp_path / "rewards.py").write_text(
        "import time\n\ndef score(response, answer, line):\n    time.sleep(0.2)\n    return 1\n"
    )
    problem = steps.problems(_config(data, reward=f"{tmp_path}/rewards.py:score", reward_timeout_s=5))[0][0]
    assert reward_of(problem, problem.answer, finished=True) == 1.0
    with pytest.raises(ValidationError, match="reward_timeout_s: limits reward's function; this task has no reward"):
        _config(data, reward_timeout_s=5)


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


def test_a_local_run_trains_on_one_file_and_evaluates_on_others_whole(tmp_path):
    bench = {"name": "bench", "data": _write(tmp_path / "bench.jsonl", BENCH), "train_size": 0, "test_size": 8}
    squares = [{"prompt": f"{a}^2=", "answer": a * a} for a in range(5)]
    squares = {"name": "squares", "data": _write(tmp_path / "squares.jsonl", squares), "train_size": 0, "test_size": 5}
    (tmp_path / "rewards.py").write_text(REWARD)  # the trained task's and a benchmark's: train and evaluate call it
    reward = f"{tmp_path}/rewards.py:score"
    config = _config(_write(tmp_path / "sums.jsonl"), bench, {**squares, "reward": reward}, test_size=0, reward=reward)
    config.evaluation.test_prompts = 0  # each benchmark whole
    finished = run_to_end(config, tmp_path / "run", out=open(tmp_path / "out", "w"))
    report = finished.report.read_text()
    sums, bench = (hashlib.sha256((tmp_path / f).read_bytes()).hexdigest()[:12] for f in ("sums.jsonl", "bench.jsonl"))
    digest = hashlib.sha256(REWARD.encode()).hexdigest()[:12]
    summary = (  # the pinned files'
        f"tasks: sums (`{tmp_path}/sums.jsonl`, sha256 {sums}, rewarded by `{reward}` (sha256 {digest}), trained on "
        f"only), bench (`{tmp_path}/bench.jsonl`, sha256 {bench}, evaluated on only), squares ("
    )
    assert summary in report
    assert "| bench pass@1 |" in report and "| bf16 | bench | trained | initial |" in report
    assert "sums pass@1" not in report and "over 8 (bench), 5 (squares) test prompts;" in report
    assert f"squares (`{tmp_path}/squares.jsonl`, sha256 " in report
    assert f"rewarded by `{reward}` (sha256 {digest}), evaluated on only)" in report
    called = set((tmp_path / "calls.txt").read_text().splitlines())
    assert any("^2=" in prompt for prompt in called) and any("+" in prompt for prompt in called)
    assert not any("*" in prompt for prompt in called)  # bench's: math-verify
