"""The program-synthesis language: results, clear errors, and bounded
execution of hostile programs (model output is never run by Python)."""

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracefp4.components.interpreter import (
    MAX_CHARS,
    MAX_INT,
    MAX_LEN,
    MAX_STEPS,
    Machine,
    ProgramError,
    check_value,
    format_value,
    parse,
    run,
)


@pytest.mark.parametrize(
    "program, value, expected",
    [
        ("sum", [1, 2, 3], 6),
        ("map +1 | filter even | sum", [1, 2, 3], 6),
        ("filter odd | map sq | sum", [1, 2, 3], 10),
        ("map (*2 | +1)", [1, 2], [3, 5]),
        ("filter (%3 | =0)", [3, 4, 6, 7], [3, 6]),
        ("sort | rev | take 2", [3, 1, 2], [3, 2]),
        ("drop 1 | head", [7, 8, 9], 8),
        ("last", [7, 8, 9], 9),
        ("max | - 3", [4, -9, 5], 2),
        ("min | neg | abs", [4, -9, 5], 9),
        ("len | range | rev", [5, 5, 5], [2, 1, 0]),
        ("filter >-1", [-1, 0, 1], [0, 1]),
        ("map <0", [-1, 0, 1], [1, 0, 0]),
        ("/2", -7, -4),  # floor division
        ("%3", -7, 2),  # modulo follows the divisor's sign
        ("map odd", [-3, -2], [1, 0]),
        ("*-1|+ -4", 3, -7),
        ("take 10", [1, 2], [1, 2]),
        ("sum", [], 0),
        ("  sq\t", 12, 144),
        ("((sum))", (1, 2), 3),  # a tuple is a list
    ],
)
def test_programs(program, value, expected):
    assert run(program, value) == expected
    assert run(program, value) == expected  # deterministic, input untouched
    assert isinstance(value, tuple) or check_value(value) == value


@pytest.mark.parametrize(
    "program, value, message",
    [
        ("map +1 | bogus", [1], "position 9: unknown word 'bogus'"),
        ("sum |", [1], "position 5: expected a stage, found the end"),
        ("(sum", [1], "expected ')', found the end"),
        ("sum)", [1], "position 3: unexpected ')'"),
        ("(sum len)", [1], "position 5: expected ')', found 'len'"),
        ("+ x", 1, "position 2: expected a number, found 'x'"),
        ("take", [1], "expected a number"),
        ("|", [1], "position 0: expected a stage, found '|'"),
        ("12", 1, "position 0: expected a stage, found '12'"),
        ("", 1, "empty program"),
        ("  ", 1, "empty program"),
        ("/0", 5, "position 0: division by zero"),
        ("map %0", [5], "position 4: division by zero"),
        ("head", [], "position 0: 'head' of an empty list"),
        ("sum | max", [1], "position 6: 'max' expects a list, got an int"),
        ("+1", [1], "position 0: '+' expects an int, got a list"),
        ("map range", [1], "position 0: the stage under 'map' must give an int"),
        ("range", MAX_LEN + 1, "'range' of 65"),
        ("take -1", [1], "'take' needs a count >= 0"),
        ("sq | sq | sq | sq", 1000, "position 5: 'sq' leaves the integer range"),
    ],
)
def test_errors_name_position_and_problem(program, value, message):
    with pytest.raises(ProgramError, match=re.escape(message)):
        run(program, value)


def test_program_error_is_a_value_error():
    assert issubclass(ProgramError, ValueError)


@pytest.mark.parametrize(
    "value", [True, 1.5, "3", None, [1, [2]], [1.0], [True], list(range(MAX_LEN + 1)), MAX_INT, [-MAX_INT]]
)
def test_bad_inputs(value):
    with pytest.raises(ProgramError):
        run("len", value)


def test_step_budget():
    machine = Machine(max_steps=10)
    with pytest.raises(ProgramError, match="step budget of 10 exceeded"):
        machine.run("map +1", list(range(20)))
    assert machine.steps == 10
    machine = Machine()
    assert machine.run("map +1 | sum", [1, 2, 3]) == 9
    assert machine.steps == 1 + 3 + 1  # map, one per element, sum


def test_format_value():
    assert format_value([1, -2, 3]) == "[1,-2,3]"
    assert format_value([]) == "[]"
    assert format_value(-7) == "-7"


def test_parse_gives_stages():
    stages = parse("map (*2 | +1) | sum")
    assert [s.op for s in stages] == ["map", "sum"]
    assert [s.op for s in stages[0].body[0].body] == ["*", "+"]
    assert stages[0].body[0].body[0].arg == 2


HOSTILE = [
    ("sq | sq | sq | sq | sq | sq | sq | sq", 10),  # repeated squaring
    ("*999999999999 | *999999999999", 5),
    ("+" + "9" * 500, 1),  # a literal far beyond the bound, below the source limit
    ("+1 | " * 200 + "+1", 1),  # a very long program
    ("9" * 100_000, 1),
    ("(" * 100 + "sum" + ")" * 100, [1]),  # deep nesting
    ("map " * 50 + "+1", [1]),
    ("map (" + "+1|" * 120 + "+1)", list(range(MAX_LEN))),  # runs past the step budget
    ("map (+1|+1|+1|+1|+1|+1|+1|+1|+1) | " * 3 + "sum", list(range(MAX_LEN))),
    ("len | *2 | range", list(range(MAX_LEN))),  # a list past the length bound
    ("__import__('os').system('x')", 1),
    ("open('/etc/passwd')", 1),
    ("lambda x: x", 1),
    ("().__class__.__bases__[0].__subclasses__()", 1),
    ("sum.__globals__", [1]),
    ("x.y", 1),
    ("f'{1}'", 1),
    ("'%s' % 1", 1),
    ("'{0}'.format(1)", 1),
    ("eval('1')", 1),
    ("exec", 1),
    ("sum\x00", [1]),
    ("\x00", 1),
    ("１+１", 1),  # fullwidth digits
    ("+١", 1),  # Arabic-Indic digit
    ("ѕum", [1]),  # Cyrillic s
    ("sum\u200b", [1]),  # zero-width space
    ("𝐬𝐮𝐦", [1]),  # mathematical bold letters
    ("sum\u00a0| len", [1]),  # non-breaking space
    ("sum\n| len", [1]),  # programs are one line
    ("\\x73um", [1]),
    (None, 1),
    (b"sum", [1]),
]


@pytest.mark.parametrize("program, value", HOSTILE)
def test_hostile_programs_end_in_program_error_quickly(program, value):
    start = time.perf_counter()
    with pytest.raises(ProgramError):
        run(program, value)
    assert time.perf_counter() - start < 0.5


def test_longest_program_within_limits_runs():
    program = ("+1|" * MAX_CHARS)[: MAX_CHARS - 2] + "+1"
    assert len(program) == MAX_CHARS
    assert run(program, 0) == program.count("+1")


WORDS = [
    "map",
    "filter",
    "sum",
    "len",
    "max",
    "min",
    "head",
    "last",
    "sort",
    "rev",
    "take",
    "drop",
    "sq",
    "neg",
    "abs",
    "even",
    "odd",
    "range",
    "+",
    "-",
    "*",
    "/",
    "%",
    ">",
    "<",
    "=",
    "(",
    ")",
    "|",
    "0",
    "1",
    "2",
    "7",
    "-1",
    "999999999999",
    "1000000000000",
    "x",
    "__import__",
    "'",
    ".",
    "\x00",
    "１",
    "é",
]
VALUES = st.one_of(st.integers(-MAX_INT + 1, MAX_INT - 1), st.lists(st.integers(-(10**6), 10**6), max_size=MAX_LEN))


@settings(max_examples=400, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), max_size=40), sep=st.sampled_from([" ", "", " | "]), value=VALUES)
def test_random_token_programs_only_raise_program_error(words, sep, value):
    machine = Machine(max_steps=100)
    try:
        result = machine.run(sep.join(words), value)
    except ProgramError:
        pass
    else:
        assert check_value(result) == result
    assert machine.steps <= 100


@settings(max_examples=200, deadline=None)
@given(program=st.text(max_size=60), value=VALUES)
def test_random_text_only_raises_program_error(program, value):
    machine = Machine()
    try:
        machine.run(program, value)
    except ProgramError:
        pass
    assert machine.steps <= MAX_STEPS
