"""Verifiable tasks and their tokenizer: reference answers earn 1.0, anything
else 0.0 without raising; splits are disjoint and seeded; every character
the tasks write fits the smoke model's vocabulary."""

import json
import random
import subprocess
import sys
import typing
from collections import Counter
from pathlib import Path

import pytest

from tracefp4.components import interpreter
from tracefp4.components.tasks import (
    ARITHMETIC_LEVELS,
    COUNTDOWN_LEVELS,
    DIFFICULTIES,
    END,
    MAX_TARGET,
    PROGRAM_LEVELS,
    TASKS,
    Problem,
    canonical_answer,
    enumerated_answer,
    evaluate_expression,
    format_example,
    get_task,
    reward_of,
    split,
)
from tracefp4.components.tokenizer import UNK, build_tokenizer
from tracefp4.schemas import TaskName

ROOT = Path(__file__).resolve().parent.parent
CASES = [(name, d) for name in TASKS for d in DIFFICULTIES]


@pytest.fixture(scope="module")
def problems() -> dict:
    return {(name, d): get_task(name).generate(40, seed=0, difficulty=d) for name, d in CASES}


def test_task_names_match_the_run_schema():
    assert set(TASKS) == set(typing.get_args(TaskName))
    assert all(task.name == name for name, task in TASKS.items())
    with pytest.raises(ValueError, match="unknown task 'poetry'"):
        get_task("poetry")


@pytest.mark.parametrize("name, difficulty", CASES)
def test_reference_answers_earn_full_reward(problems, name, difficulty):
    task = get_task(name)
    for problem in problems[name, difficulty]:
        assert problem.task == name
        assert format_example(problem) == problem.prompt
        assert task.reward(problem, problem.answer) == 1.0
        assert task.reward(problem, problem.answer + END) == 1.0
        assert task.reward(problem, f"  {problem.answer}\nwhatever follows") == 1.0
        assert task.reward(problem, f"\n{problem.answer}") == 1.0  # a chat policy's answer on its own line
        # a thinking policy (Qwen3, Qwen3.5 chat templates): the answer after its reasoning; Qwen3.5's prompt opens it
        assert task.reward(problem, f"<think>\nfirst this\n{END}</think>\n\n{problem.answer}{END}") == 1.0
        assert task.reward(problem, f"first this\n</think>\n\n{problem.answer}") == 1.0


BAD_RESPONSES = [
    "",
    " ",
    END,
    "garbage",
    "\x00\x00",
    "__import__('os').system('x')",
    "open('/etc/passwd').read()",
    "lambda: 0",
    "().__class__.__bases__[0]",
    "f'{1}'",
    "１２３",
    "9" * 100_000,
    "(" * 10_000,
    "sq | " * 1000,
    "1/0",
    "<eos>",
    None,
]


@pytest.mark.parametrize("name", TASKS)
def test_bad_responses_earn_nothing(problems, name):
    task = get_task(name)
    for problem in problems[name, 3][:10]:
        cut_off = f"<think>\n{problem.answer}{END}"  # reasoning the length limit cut: no answer yet
        for response in BAD_RESPONSES + [f"garbage{END}{problem.answer}", problem.answer + "(", cut_off]:
            assert task.reward(problem, response) == 0.0, (problem, response)
    wrong = {"arithmetic": "1" + problems[name, 3][0].answer, "countdown": "1+1", "program": "len | neg | -1"}[name]
    assert task.reward(problems[name, 3][0], wrong) == 0.0


def test_a_response_the_length_limit_cut_counts_up_to_its_last_complete_line():
    """Read whole, "357" cut from "3579" was an answer, rewarded where 357 is right."""
    problem = Problem("arithmetic", "300+57=", "357", {})
    assert reward_of(problem, "357", finished=True) == 1.0  # ended by a stop token (a chat turn's end)
    assert reward_of(problem, "357", finished=False) == 0.0
    assert reward_of(problem, f"357{END}and then", finished=False) == 1.0  # the answer line was complete
    assert reward_of(problem, f"<think>so{END}</think>{END}357", finished=False) == 0.0
    assert reward_of(problem, f"<think>so{END}</think>{END}357{END}", finished=False) == 1.0


def test_a_problem_of_another_task_is_refused(problems):
    with pytest.raises(ValueError, match="a 'countdown' problem given to the 'arithmetic' task"):
        get_task("arithmetic").reward(problems["countdown", 1][0], "1")


def test_arithmetic_difficulty_sets_operands_and_digits(problems):
    for d in DIFFICULTIES:
        operands, digits = ARITHMETIC_LEVELS[d]
        for p in problems["arithmetic", d]:
            assert len(p.meta["operands"]) == operands
            assert all(len(str(x)) == digits for x in p.meta["operands"])
            assert p.prompt.endswith("=") and sum(p.prompt.count(op) for op in "+-*") == operands - 1
    assert get_task("arithmetic").reward(Problem("arithmetic", "2+3*4=", "14", {}), "14") == 1.0


def test_countdown_instances_are_solvable_and_scale(problems):
    for d in DIFFICULTIES:
        count, largest = COUNTDOWN_LEVELS[d]
        for p in problems["countdown", d]:
            numbers, target = p.meta["numbers"], p.meta["target"]
            assert len(numbers) == count and all(1 <= x <= largest for x in numbers)
            assert p.prompt == f"numbers {' '.join(map(str, numbers))} target {target}:"
            value, used = evaluate_expression(p.answer)
            assert value == target and Counter(used) == Counter(numbers)
            assert p.answer == canonical_answer(numbers, target)


def test_countdown_answer_is_one_per_prompt():
    """The reference answer depends on the prompt alone (the multiset and the target), whatever the draw built."""
    assert canonical_answer([2, 3, 7], 13) == canonical_answer([7, 2, 3], 13) == "7+3*2"
    assert canonical_answer([3, 8, 8], 40) == "8*(8-3)"
    assert canonical_answer([2, 3, 7], 1000) is None  # unreachable with each number once


def test_countdown_answer_is_the_first_reaching_expression_of_the_enumeration():
    """canonical_answer finds its answer from the parts' values; its definition
    writes every expression out (enumerated_answer). Both agree on prompts of
    every difficulty, targets out of reach, and non-positive ones."""
    rng = random.Random(0)
    for difficulty, (count, largest) in COUNTDOWN_LEVELS.items():
        for _ in range(60 if difficulty < 5 else 12):
            numbers = [rng.randint(1, largest) for _ in range(count)]
            for target in (rng.randint(1, MAX_TARGET), rng.randint(1, 30), rng.randint(-2, 0)):
                assert canonical_answer(numbers, target) == enumerated_answer(numbers, target), (numbers, target)


def test_the_tasks_benchmark_checks_the_answers_it_times():
    command = [sys.executable, "benchmarks/tasks.py", "--preset", "tiny", "--prompts", "20"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["countdown_prompts"] == 20 and figures["countdown_search_speedup"] > 0
    assert figures["arithmetic_d1_problems"] == 300 and figures["countdown_d1_split_s"] >= 0


def test_countdown_checks_numbers_and_target():
    task = get_task("countdown")
    problem = Problem("countdown", "numbers 2 3 7 target 13:", "2*3+7", {"numbers": [2, 3, 7], "target": 13})
    for right in ["2*3+7", "7+3*2", "(7 + 3 * 2)", "7+2*3"]:
        assert task.reward(problem, right) == 1.0
    for wrong in ["13", "7+3+3", "2*7-1", "7*2-1", "2*3+7+0", "-2+15", "26/2", "2*3*7", "7+6", "(2*3+7"]:
        assert task.reward(problem, wrong) == 0.0, wrong
    exact = Problem("countdown", "numbers 2 7 target 3:", "7-2*2", {"numbers": [2, 7], "target": 3})
    assert task.reward(exact, "7/2") == 0.0  # inexact division is not allowed


@pytest.mark.parametrize(
    "text, value, numbers",
    [
        ("2+3*4", 14, [2, 3, 4]),
        ("(2+3)*4", 20, [2, 3, 4]),
        ("8/4/2", 1, [8, 4, 2]),
        ("9-4-3", 2, [9, 4, 3]),
        ("0", 0, [0]),
    ],
)
def test_evaluate_expression(text, value, numbers):
    assert evaluate_expression(text) == (value, numbers)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "7/2",
        "8/0",
        "1+",
        "+1",
        "007",
        "2**3",
        "2 3",
        "()",
        "1e3",
        "١",
        "1" * 13,
        "(" * 20 + "1" + ")" * 20,
        "1+" * 101 + "1",
    ],
)
def test_evaluate_expression_refuses(text):
    with pytest.raises(ValueError):
        evaluate_expression(text)


def test_program_difficulty_sets_stages_and_values(problems):
    for d in DIFFICULTIES:
        stages, low, high, _ = PROGRAM_LEVELS[d]
        for p in problems["program", d]:
            assert len(interpreter.parse(p.answer)) == stages
            examples = [*p.meta["examples"], p.meta["hidden"]]
            assert len(p.meta["examples"]) == (2 if d == 1 else 3)
            assert all(low <= v <= high for x, _ in examples for v in x)
            assert all(
                f"{interpreter.format_value(x)}->{interpreter.format_value(y)}" in p.prompt
                for x, y in p.meta["examples"]
            )
            assert p.meta["hidden"][0] not in [x for x, _ in p.meta["examples"]]


def test_program_reward_needs_the_hidden_example():
    task = get_task("program")
    meta = {"examples": [[[1, 2, 3], 6], [[2, 2, 2], 6]], "hidden": [[5], 5]}
    problem = Problem("program", "[1,2,3]->6; [2,2,2]->6; program:", "sum", meta)
    assert task.reward(problem, "sum") == 1.0
    assert task.reward(problem, "rev | sum | *1") == 1.0  # any program that reproduces every example
    assert task.reward(problem, "len | *2") == 0.0  # right on the shown examples only
    assert task.reward(problem, "map") == 0.0


@pytest.mark.parametrize("name", TASKS)
def test_splits_are_disjoint_and_seeded(name):
    train, test = split(name, 30, 10, seed=1, difficulty=2)
    assert len(train) == 30 and len(test) == 10
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert len({p.prompt for p in train}) == 30
    assert split(get_task(name), 30, 10, seed=1, difficulty=2) == (train, test)
    assert split(name, 30, 10, seed=2, difficulty=2)[0] != train
    assert split(name, 30, 10, seed=1, difficulty=3)[0] != train


def test_split_holds_out_the_same_distribution_it_trains_on():
    # 2,500 of countdown difficulty 1's 2,700 prompts, as the science run draws: the first prompts drawn are the
    # likeliest (the sum of the numbers, reachable by many expressions); held out first, they made the test set
    # the head of the distribution (the sum: 18.2% of test, 6.2% of train)
    train, test = split("countdown", 2000, 500, seed=0, difficulty=1)

    def summed(problems):
        return sum(sum(p.meta["numbers"]) == p.meta["target"] for p in problems) / len(problems)

    assert abs(summed(test) - summed(train)) < 0.05  # 2.9 points here; the sampling SD of the gap is 1.4
    assert not {p.prompt for p in train} & {p.prompt for p in test}


def test_generation_limits():
    with pytest.raises(ValueError, match="difficulty 6 is outside 1..5"):
        get_task("program").generate(1, seed=0, difficulty=6)
    with pytest.raises(ValueError, match="difficulty 1: 300 distinct problems drawn, not 1000, before"):
        get_task("arithmetic").generate(1000, seed=0, difficulty=1)  # 10 x 3 x 10 prompts exist
    assert len(get_task("arithmetic").generate(288, seed=0, difficulty=1)) == 288  # the tiny preset's size


def test_generation_skips_excluded_prompts():
    every = get_task("arithmetic").generate(300, seed=0, difficulty=1)  # all of difficulty 1
    excluded = frozenset(p.prompt for p in every[:250])
    rest = get_task("arithmetic").generate(50, seed=0, difficulty=1, exclude=excluded)
    assert {p.prompt for p in rest} == {p.prompt for p in every[250:]}
    assert rest == get_task("arithmetic").generate(50, seed=0, difficulty=1, exclude=excluded)  # seeded
    with pytest.raises(ValueError, match="50 distinct problems drawn, not 51 outside the 250 excluded, before"):
        get_task("arithmetic").generate(51, seed=0, difficulty=1, exclude=excluded)


@pytest.mark.parametrize("name", TASKS)
def test_every_character_fits_the_smoke_vocabulary(problems, name):
    tok = build_tokenizer()
    for d in DIFFICULTIES:
        for p in problems[name, d]:
            for text in (format_example(p), p.answer + END):
                ids = tok.encode(text)
                assert UNK not in ids and max(ids) < 256 and len(ids) == len(text)
                assert tok.decode(ids) == text


def test_a_task_without_enough_distinct_problems_names_its_entry():
    from tracefp4.components.steps import task_splits
    from tracefp4.schemas import load_config

    tasks = [{"name": "countdown", "train_size": 8, "test_size": 16}, {"name": "arithmetic", "train_size": 400}]
    config = load_config(None, overrides={"tasks": tasks})  # arithmetic at difficulty 1 has 300 problems
    with pytest.raises(
        ValueError,
        match=r"tasks.1: train_size 400 \+ test_size \d+: arithmetic at difficulty 1: 300 distinct problems drawn, not",
    ):
        task_splits(config)
