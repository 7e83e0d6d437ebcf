"""Verifiable tasks: problems whose reward a program computes.

Three generated families, each with difficulty 1 (easiest) to 5 and seeded generation:

- ``arithmetic``: ``12+345=`` -> ``357`` (difficulty: operands and digits);
- ``countdown``: ``numbers 3 7 25 target 46:`` -> ``25+3*7`` (each number at most
  once, + - * and exact /; difficulty: how many numbers, how large);
- ``program``: ``[3,1,2]->[1,3]; [5,4]->[5]; program:`` -> ``filter odd | sort``
  in the language of :mod:`.interpreter` (difficulty: stages, value range).

A response is read up to the first newline (:data:`END`, the end marker a
policy with a plain tokenizer learns to write after its answer, see
:meth:`.tokenizer.PolicyTokenizer.encode_answer`); its reward is 1.0 when correct and
0.0 for anything else, garbage included, never an exception. Answers are
checked by small parsers here and in :mod:`.interpreter`, never by Python's
``eval``.

Besides them, a user's problems read from a file (:class:`FileTask`, a JSON
object a line with a ``prompt`` and an ``answer``), rewarded by whether the
response's final answer equals the reference mathematically (math-verify, the
checker of open-r1, TRL and verl), as reasoning RL on math is, or by a
function of the user's own (:class:`RewardFunction`).
"""

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import itertools
import json
import logging
import math
import numbers
import random
import re
import signal
import sys
import threading
import traceback
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from . import interpreter
from .interpreter import ProgramError, format_value

END = "\n"
# Qwen3 and Qwen3.5 chat templates think first by default: "<think>...</think>" then the answer (Qwen3.5's
# generation prompt itself ends with "<think>\n", so its responses hold only the closing tag)
THINK_START, THINK_END = "<think>", "</think>"
DIFFICULTIES = (1, 2, 3, 4, 5)
MAX_EXPRESSION = 200  # characters of a countdown answer
_EXPRESSION_DEPTH = 16
_DIGITS = "0123456789"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """One generated problem; ``answer`` is a reference answer, ``meta`` what the reward checks against."""

    task: str
    prompt: str
    answer: str
    meta: dict
    # how a file's problem is scored where not by math-verify (a task's own function: the problem is the same
    # problem whoever scores it)
    reward: "RewardFunction | None" = field(default=None, compare=False, repr=False)


class Task(Protocol):
    name: str

    def generate(self, n: int, seed: int, difficulty: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
        """``n`` problems with distinct prompts, none in ``exclude``, the same for the same arguments."""
        ...

    def draws(self, n: int, seed: int, difficulty: int, exclude: frozenset[str] = frozenset()) -> Iterator[Problem]:
        """:meth:`generate`'s problems one at a time, as they are drawn."""
        ...

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 if ``response`` solves ``problem``, else 0.0; never raises on a bad response."""
        ...


def format_example(problem: Problem) -> str:
    """What the policy is given."""
    return problem.prompt


def _answer_text(response: str) -> str:
    """The part of a response that counts: after a thinking policy's reasoning
    (none while it is still open, cut off by the length limit), up to the end
    marker, trimmed."""
    if not isinstance(response, str):
        return ""
    _, thought, answer = response.rpartition(THINK_END)
    if thought:
        response = answer
    elif THINK_START in response:
        return ""
    return response.lstrip().partition(END)[0].strip()  # a chat policy may open its answer with a newline


class _Generated(ABC):
    """Seeded generation of distinct problems from a task's ``draw``."""

    name: str

    @abstractmethod
    def draw(self, rng: random.Random, difficulty: int) -> Problem | None:
        """One random problem, or None to draw again."""

    def generate(self, n: int, seed: int, difficulty: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
        return list(self.draws(n, seed, difficulty, exclude))

    def draws(self, n: int, seed: int, difficulty: int, exclude: frozenset[str] = frozenset()) -> Iterator[Problem]:
        """:meth:`generate`'s problems one at a time, as they are drawn: a caller
        that keeps none holds their prompts alone (which keep them distinct)."""
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty {difficulty} is outside 1..5")
        if n < 0:
            raise ValueError(f"cannot generate {n} problems")
        # a string seed keys the stream by task and difficulty, the same in every process
        rng = random.Random(f"{self.name}/{difficulty}/{seed}")
        seen, misses = set(exclude), 0
        while len(seen) - len(exclude) < n:
            problem = self.draw(rng, difficulty)
            if problem is None or problem.prompt in seen:
                misses += 1
                if misses > 1000 + 10 * n:
                    raise ValueError(
                        f"{self.name} at difficulty {difficulty}: {len(seen) - len(exclude)} distinct problems drawn, "
                        f"not {n}"
                        + f" outside the {len(exclude)} excluded" * bool(exclude)
                        + f", before {misses} repeats (it holds fewer, or the rest are drawn too rarely)"
                    )
                continue
            seen.add(problem.prompt)
            yield problem

    def _check(self, problem: Problem) -> None:
        if problem.task != self.name:
            raise ValueError(f"a {problem.task!r} problem given to the {self.name!r} task")


# -- integer expressions: arithmetic prompts and countdown answers -------------


def _combine(op: str, a: int, b: int) -> int | None:
    """``a op b``; None for a division that is not exact."""
    if op == "/":
        return a // b if b and a % b == 0 else None
    return a + b if op == "+" else a - b if op == "-" else a * b


class _Expression:
    """Recursive descent over + - * / and parentheses with the usual precedence."""

    def __init__(self, text: str):
        self.tokens, self.i, self.numbers = [], 0, []
        i = 0
        while i < len(text):
            start = i
            if text[i] in _DIGITS:
                while i < len(text) and text[i] in _DIGITS:
                    i += 1
                number = text[start:i]
                if len(number) > 12 or (number[0] == "0" and len(number) > 1):
                    raise ValueError(f"bad number {number[:20]!r}")
                self.tokens.append(number)
                continue
            if text[i] in "+-*/()":
                self.tokens.append(text[i])
            elif text[i] != " ":
                raise ValueError(f"unexpected character {text[i]!r}")
            i += 1

    def take(self) -> str:
        if self.i == len(self.tokens):
            raise ValueError("unexpected end of expression")
        self.i += 1
        return self.tokens[self.i - 1]

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def sum(self, depth: int) -> int:
        value = self.product(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            value = _combine(op, value, self.product(depth))
        return value

    def product(self, depth: int) -> int:
        value = self.atom(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            value = _combine(op, value, self.atom(depth))
            if value is None:
                raise ValueError("division is not exact")
        return value

    def atom(self, depth: int) -> int:
        if depth > _EXPRESSION_DEPTH:
            raise ValueError("parentheses nested too deep")
        token = self.take()
        if token == "(":
            value = self.sum(depth + 1)
            if self.take() != ")":
                raise ValueError("missing ')'")
            return value
        if token[0] not in _DIGITS:
            raise ValueError(f"expected a number, found {token!r}")
        self.numbers.append(int(token))
        return int(token)


def evaluate_expression(text: str) -> tuple[int, list[int]]:
    """The value of an integer expression (+ - * / and parentheses, / only when
    exact, no unary minus) and the numbers it uses in order; ValueError otherwise."""
    if len(text) > MAX_EXPRESSION:
        raise ValueError(f"expression of {len(text)} characters; the limit is {MAX_EXPRESSION}")
    parser = _Expression(text)
    value = parser.sum(0)
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()!r}")
    return value, parser.numbers


# -- arithmetic --------------------------------------------------------------

ARITHMETIC_LEVELS = {1: (2, 1), 2: (2, 2), 3: (3, 2), 4: (3, 3), 5: (4, 3)}  # difficulty: (operands, digits)


class Arithmetic(_Generated):
    name = "arithmetic"

    def draw(self, rng: random.Random, difficulty: int) -> Problem:
        operands, digits = ARITHMETIC_LEVELS[difficulty]
        low = 10 ** (digits - 1) if digits > 1 else 0
        numbers = [rng.randrange(low, 10**digits) for _ in range(operands)]
        expression = str(numbers[0]) + "".join(rng.choice("+-*") + str(x) for x in numbers[1:])
        value, _ = evaluate_expression(expression)
        return Problem(self.name, expression + "=", str(value), {"operands": numbers, "digits": digits})

    def reward(self, problem: Problem, response: str) -> float:
        self._check(problem)
        return float(_answer_text(response) == problem.answer)


# -- countdown ---------------------------------------------------------------

COUNTDOWN_LEVELS = {1: (3, 10), 2: (3, 25), 3: (4, 25), 4: (4, 50), 5: (5, 100)}  # difficulty: (numbers, largest)
MAX_TARGET = 1000


def _join(left: tuple[str, int, int], right: tuple[str, int, int], op: str) -> tuple[str, int, int] | None:
    """``left op right`` as (text, value, precedence), parenthesized where the
    usual precedence needs it; None unless the value is a positive integer."""
    (left_text, a, left_prec), (right_text, b, right_prec) = left, right
    value = _combine(op, a, b)
    if value is None or value <= 0:
        return None
    prec = 1 if op in "+-" else 2
    if left_prec < prec:
        left_text = f"({left_text})"
    if right_prec < prec or (right_prec == prec and op in "-/"):
        right_text = f"({right_text})"
    return left_text + op + right_text, value, prec


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, int, int] | None:
    """A random expression using every number once in the given order, with
    positive integer intermediates: (text, value, precedence), or None."""
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0], 3
    k = rng.randint(1, len(numbers) - 1)
    left, right = _random_expression(rng, numbers[:k]), _random_expression(rng, numbers[k:])
    if left is None or right is None:
        return None
    for op in rng.sample("+-*/", 4):
        joined = _join(left, right, op)
        if joined is not None:
            return joined
    return None


def _expressions(numbers: tuple[int, ...]):
    """Every expression over ``numbers`` in this order (each once, positive
    integer intermediates) as (text, value, precedence), lazily, in a fixed
    order: the split point from the left, then the left side's expressions,
    the right side's, and the operators + - * /."""
    if len(numbers) == 1:
        yield str(numbers[0]), numbers[0], 3
        return
    for k in range(1, len(numbers)):
        for left in _listed(numbers[:k]):
            for right in _listed(numbers[k:]):
                for op in "+-*/":
                    joined = _join(left, right, op)
                    if joined is not None:
                        yield joined


@functools.lru_cache(maxsize=1024)
def _listed(numbers: tuple[int, ...]) -> tuple[tuple[str, int, int], ...]:
    """:func:`_expressions` of a part, kept: the parts of one problem's orderings recur."""
    return tuple(_expressions(numbers))


@functools.lru_cache(maxsize=4096)
def _values(numbers: tuple[int, ...]) -> frozenset[int]:
    """The values the expressions over ``numbers`` in this order reach (each
    number once, positive integer intermediates: :func:`_join`), without their texts."""
    if len(numbers) == 1:
        return frozenset(numbers)
    values = set()
    for k in range(1, len(numbers)):
        rights = _values(numbers[k:])
        for a in _values(numbers[:k]):
            for b in rights:  # + - * and exact /, as _combine
                values.update((a + b, a - b, a * b, a // b if b and a % b == 0 else 0))
    return frozenset(v for v in values if v > 0)


def _taking(a: int, rights: frozenset[int], wanted: set[int]) -> set[int]:
    """The values ``b`` among ``rights`` for which ``a op b`` is in ``wanted``
    (positive values) for some op of + - * and exact /: from each wanted
    value, the operand of each op that reaches it."""
    operands = ((w - a, a - w, w // a if a and w % a == 0 else 0, a // w if a % w == 0 else 0) for w in wanted)
    return {b for four in operands for b in four if b in rights}


def _first(numbers: tuple[int, ...], wanted: set[int]) -> tuple[str, int, int] | None:
    """The first of :func:`_expressions` over ``numbers`` whose value is in
    ``wanted``, or None, found from the parts' values alone: the left values
    that some right value takes into ``wanted``, the first expression of the
    left part reaching one, then the first of the right part that it needs.
    The expressions before it are never written out; a difficulty-5 prompt's
    five numbers have thousands per ordering, and 20,000 prompts took over a
    minute to enumerate in every step that draws the tasks (docs/evaluation.md)."""
    if len(numbers) == 1:
        return (str(numbers[0]), numbers[0], 3) if numbers[0] in wanted else None
    for k in range(1, len(numbers)):
        left_part, right_part = numbers[:k], numbers[k:]
        rights = _values(right_part)
        lefts = {a for a in _values(left_part) if _taking(a, rights, wanted)}
        if lefts:
            left = _first(left_part, lefts)
            right = _first(right_part, _taking(left[1], rights, wanted))
            return next(j for op in "+-*/" if (j := _join(left, right, op)) is not None and j[1] in wanted)
    return None


def canonical_answer(numbers: list[int], target: int) -> str | None:
    """The one reference answer of a countdown prompt: over the orderings of
    ``numbers`` from the largest first, the first expression using every
    number that reaches ``target`` (:func:`_expressions`' order); None if
    none does. Found from values (:func:`_first`); :func:`enumerated_answer`,
    which writes the expressions out, is its definition, which tests and
    ``benchmarks/tasks.py`` compare it with.

    Why one per prompt: a prompt has many solutions, and the generator's
    random draw picks any. SFT on those teaches a spread over forms whose
    greedy decode mixes them into invalid answers. On the science preset
    (2,000 training problems) the tiny model reached 15.8% held-out after 600
    SFT steps with drawn answers (commit cb90d70) and reaches 32.2% with this
    one: ``python benchmarks/science.py --bootstrap-only --seeds 1 --sft-steps 600``."""
    orderings = dict.fromkeys(itertools.permutations(sorted(numbers, reverse=True)))  # repeated numbers: once
    wanted = {target} if target > 0 else set()  # every expression's value is positive
    found = (expression for order in orderings if (expression := _first(order, wanted)) is not None)
    return next(found, (None,))[0]


def enumerated_answer(numbers: list[int], target: int) -> str | None:
    """:func:`canonical_answer` by its definition: every expression written
    out, ordering by ordering, until one reaches ``target``."""
    orderings = dict.fromkeys(itertools.permutations(sorted(numbers, reverse=True)))
    found = (text for order in orderings for text, value, _ in _expressions(order) if value == target)
    return next(found, None)


class Countdown(_Generated):
    name = "countdown"

    def draw(self, rng: random.Random, difficulty: int) -> Problem | None:
        count, largest = COUNTDOWN_LEVELS[difficulty]
        numbers = [rng.randint(1, largest) for _ in range(count)]
        built = _random_expression(rng, numbers)
        if built is None or not 1 <= built[1] <= MAX_TARGET or built[1] in numbers:
            return None
        target = built[1]
        numbers.sort()  # the prompt shows a multiset, whatever order the expression drew
        prompt = f"numbers {' '.join(map(str, numbers))} target {target}:"
        # the drawn expression is one of the solutions canonical_answer searches, so it finds one
        return Problem(self.name, prompt, canonical_answer(numbers, target), {"numbers": numbers, "target": target})

    def reward(self, problem: Problem, response: str) -> float:
        self._check(problem)
        try:
            value, used = evaluate_expression(_answer_text(response))
        except ValueError:
            return 0.0
        unavailable = Counter(used) - Counter(problem.meta["numbers"])
        return float(value == problem.meta["target"] and not unavailable)


# -- program synthesis ---------------------------------------------------------

# difficulty: (stages, lowest element, highest element, two-stage bodies under map/filter)
PROGRAM_LEVELS = {
    1: (1, 0, 9, False),
    2: (2, 0, 9, False),
    3: (2, -9, 9, False),
    4: (3, -9, 9, True),
    5: (4, -20, 20, True),
}
_SHOWN_LEN = 8  # longest list an example shows
_SHOWN_INT = 10**5  # largest integer an example shows


_FUNCTION_ARGS = {"+": (1, 9), "-": (1, 9), "*": (2, 5), "/": (2, 4), "%": (2, 5)}  # literal range per operator


def _function(rng: random.Random, composite: bool) -> str:
    if composite and rng.random() < 0.3:
        return f"({_function(rng, False)} | {_function(rng, False)})"
    op = rng.choice([*_FUNCTION_ARGS, "sq", "neg", "abs"])
    return f"{op}{rng.randint(*_FUNCTION_ARGS[op])}" if op in _FUNCTION_ARGS else op


def _predicate(rng: random.Random, low: int, high: int, composite: bool) -> str:
    if composite and rng.random() < 0.3:
        return f"({_function(rng, False)} | {_predicate(rng, low, high, False)})"
    op = rng.choice(["even", "odd", ">", "<"])
    return f"{op}{rng.randint(low, high)}" if op in (">", "<") else op


def _stage(rng: random.Random, low: int, high: int, composite: bool) -> str:
    kind = rng.choice(["map", "filter", "list", "count", "reduce", "int"])
    if kind == "map":
        return f"map {_function(rng, composite)}"
    if kind == "filter":
        return f"filter {_predicate(rng, low, high, composite)}"
    if kind == "list":
        return rng.choice(["sort", "rev"])
    if kind == "count":
        return f"{rng.choice(['take', 'drop'])} {rng.randint(1, 3)}"
    if kind == "reduce":
        return rng.choice(["sum", "len", "max", "min", "head", "last"])
    return "range" if rng.random() < 0.2 else _function(rng, False)


def _shown(value) -> bool:
    values = value if isinstance(value, list) else [value]
    return len(values) <= _SHOWN_LEN and all(abs(v) < _SHOWN_INT for v in values)


class ProgramSynthesis(_Generated):
    name = "program"

    def draw(self, rng: random.Random, difficulty: int) -> Problem | None:
        stages, low, high, composite = PROGRAM_LEVELS[difficulty]
        shown = 2 if difficulty == 1 else 3
        inputs = []
        while len(inputs) < shown + 1:  # the last one is held out
            x = [rng.randint(low, high) for _ in range(rng.randint(3, 6))]
            if x not in inputs:
                inputs.append(x)
        program, outputs = [], inputs
        for _ in range(stages):
            for _attempt in range(20):  # draw again for a stage of the wrong type, or one that changes nothing
                stage = _stage(rng, low, high, composite)
                try:
                    changed = [interpreter.run(" | ".join([*program, stage]), x) for x in inputs]
                except ProgramError:
                    continue
                if changed != outputs:
                    program.append(stage)
                    outputs = changed
                    break
            else:
                return None
        constant = all(y == outputs[0] for y in outputs)
        uninformative = outputs == inputs or outputs.count([]) > 1
        if constant or uninformative or not all(map(_shown, outputs)):
            return None
        examples = [[x, y] for x, y in zip(inputs, outputs)]
        prompt = "; ".join(f"{format_value(x)}->{format_value(y)}" for x, y in examples[:shown]) + "; program:"
        meta = {"examples": examples[:shown], "hidden": examples[shown]}
        return Problem(self.name, prompt, " | ".join(program), meta)

    def reward(self, problem: Problem, response: str) -> float:
        self._check(problem)
        program = _answer_text(response)
        try:
            examples = [*problem.meta["examples"], problem.meta["hidden"]]
            correct = all(interpreter.run(program, x) == y for x, y in examples)
        except ProgramError:
            return 0.0
        return float(correct)


# -- problems from a file ------------------------------------------------------

# math-verify interrupts a parse or a comparison that runs longer (signal.alarm, so whole seconds and the main
# thread): a policy's "9^9^9^9" would otherwise hold the step for as long as sympy takes
MATH_TIMEOUT_S = 1


@functools.cache
def _math_verify():
    """math-verify, with how it reads a reference answer (the inside of a
    ``\\boxed{}``) and a response (its last ``\\boxed{}``, else its LaTeX, else
    an expression): imported on first use, since its sympy takes half a
    second that only file tasks need."""
    import math_verify
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    logging.getLogger("math_verify.parser").addFilter(_cut_short)
    return math_verify, (LatexExtractionConfig(),), (LatexExtractionConfig(), ExprExtractionConfig())


def _cut_short(record: logging.LogRecord) -> bool:
    """math-verify's parsing timeout warns with the whole response, which at a reasoning model's 32K tokens
    would fill a step's log: the first 200 characters say which."""
    message = record.getMessage()
    if len(message) > 200:
        record.msg, record.args = message[:200] + f"... ({len(message)} characters)", ()
    return True


@functools.lru_cache(maxsize=65536)
def parsed_answer(answer: str) -> list:
    """A reference answer as math-verify reads it (empty where it cannot: no
    response would ever match it); cached, since every response to a
    problem is compared with it."""
    math_verify, gold, _ = _math_verify()
    return math_verify.parse(f"\\boxed{{{answer}}}", gold, parsing_timeout=MATH_TIMEOUT_S)


_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{3,}")


def _bare_answer(text: str) -> str | None:
    """``text`` where it is an answer and nothing else, read as a reference
    answer is: one line without LaTeX's delimiters (``$``, ``\\boxed``), no
    sentence (no word of three letters or more, outside a LaTeX command, beside
    a space): ``x+1``, ``\\sqrt{2}``, ``2^{10}``, ``(1, 2]``, ``B``, as
    bootstrap teaches a policy to answer. math-verify reads a response's
    undelimited text as an expression of numbers alone, ``x+1`` as nothing and
    ``2^{10}`` as its first number, 2."""
    line = text.strip().removesuffix(".")
    if not line or "\n" in line or any(mark in line for mark in ("$", "\\boxed", "\\(", "\\[")):
        return None
    return None if " " in line and _WORD.search(_LATEX_COMMAND.sub(" ", line)) else line


def math_reward(problem: Problem, response: str) -> float:
    """1.0 when the final answer of ``response`` (after a thinking policy's
    reasoning: an answer alone, read as the reference is; else its last
    ``\\boxed{}``, else its last expression) equals ``problem.answer``
    mathematically (``0.5`` and ``\\frac{1}{2}``, ``x+1`` and ``1+x``), else
    0.0."""
    if not isinstance(response, str):
        return 0.0
    _, thought, answer = response.rpartition(THINK_END)
    if not thought and THINK_START in response:
        return 0.0  # still thinking when it stopped
    # math-verify answers nonsense with nothing read (or False), and raises only off the main thread
    math_verify, _, read = _math_verify()
    final = answer if thought else response
    if (alone := _bare_answer(final)) is not None:
        said = parsed_answer(alone)
    else:
        said = math_verify.parse(final, read, parsing_timeout=MATH_TIMEOUT_S)
    return float(math_verify.verify(parsed_answer(problem.answer), said, timeout_seconds=MATH_TIMEOUT_S))


class FileTask:
    """A user's problems, read from a file of JSON Lines (:func:`read_problems`),
    drawn in a seeded order and rewarded by :func:`math_reward`. Difficulty
    is the generated families' knob: the file's problems are what they are."""

    def __init__(self, name: str, problems: list[Problem], source: str):
        self.name, self.problems, self.source = name, problems, source

    def generate(self, n: int, seed: int, difficulty: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
        return list(self.draws(n, seed, difficulty, exclude))

    def draws(self, n: int, seed: int, difficulty: int, exclude: frozenset[str] = frozenset()) -> Iterator[Problem]:
        order = list(self.problems)
        random.Random(f"{self.name}/{seed}").shuffle(order)
        chosen = [p for p in order if p.prompt not in exclude][:n]
        if len(chosen) < n:
            raise ValueError(
                f"{self.source} holds {len(chosen)} distinct problems"
                + f" outside the {len(exclude)} excluded" * bool(exclude)
                + f", not {n}"
            )
        yield from chosen

    def reward(self, problem: Problem, response: str) -> float:
        return file_reward(problem, response)


def file_reward(problem: Problem, response: str) -> float:
    """A file's problem's reward: its task's own function where it has one, else math-verify's equivalence."""
    if problem.reward is None and "record" in problem.meta:  # read back from a trajectories file without it
        raise ValueError(f"a problem of task {problem.task} (line {problem.meta['line']}) lacks its reward function")
    return (problem.reward or math_reward)(problem, response)


@dataclass(frozen=True)
class RewardFunction:
    """A user's reward of the ``problems`` file's problems, ``function`` of
    the Python file ``source`` whose bytes are ``code``: called as
    ``function(response, answer, line)`` with the response's text, the
    problem's reference answer and its line's whole JSON object (what else a
    reward needs: test cases, choices), it returns a number from 0 to 1, 1 a
    solved problem. A fault of the function (an exception, another value, a
    call longer than ``timeout_s``) stops the step, naming the function and
    the line: a reward read as 0 would train on a bug, not the policy's
    error."""

    source: str
    function: str
    code: bytes = field(repr=False)
    problems: str  # the file of the problems it scores, named in its faults
    timeout_s: float  # how long one call may run (the task's reward_timeout_s)

    @property
    def name(self) -> str:
        return f"{self.source}:{self.function}"

    def __call__(self, problem: Problem, response: str) -> float:
        where = f"{self.name} on {self.problems} line {problem.meta['line']}"
        function = _loaded(self)
        try:
            with _time_limit(self.timeout_s):
                value = function(response, problem.answer, problem.meta["record"])
        except _TimedOut as e:
            raise RuntimeError(
                f"{where}: ran longer than {self.timeout_s:g} s, the task's reward_timeout_s{self._line_of(e)}: "
                "bound the function's own work (a program under test in a subprocess with a timeout), or raise "
                f"the limit; the response: {_quoted(response)}"
            ) from None
        except (Exception, SystemExit) as e:  # sys.exit() in the function would end the step without a word
            raise RuntimeError(
                f"{where}: raised {type(e).__name__}: {e}{self._line_of(e)}; the response: {_quoted(response)}"
            ) from e
        if isinstance(value, numbers.Real) and 0 <= value <= 1:  # bool, int, float, numpy's scalars
            return float(value)
        raise ValueError(
            f"{where}: returned {value!r}, not a number from 0 to 1 (1: solved); the response: {_quoted(response)}"
        )

    def _line_of(self, error: BaseException) -> str:
        """The line of the reward file (named at the start of a fault's message) that raised ``error``, its
        deepest frame there: a step's console shows the message, its log the whole traceback."""
        lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == self.source]
        if not lines:
            return ""
        text = self.code.decode(errors="replace").splitlines()[lines[-1] - 1].strip()
        return f" (at line {lines[-1]}: {text})"

    def check(self, problem: Problem) -> None:
        """Refuse a file that does not load, whose function is none or takes other arguments, or that fails
        to score ``problem`` given its own answer as the response (any response must score): before the
        run, not at its first reward. Warn where that answer scores below 1: a function that wants a form
        (a ``\\boxed{}``) would, but so would one whose arguments are others (verl's ``compute_score``
        takes the data source first), which would score every response 0 and train on nothing."""
        _loaded(self)
        try:
            value = self(problem, problem.answer)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{e} (given the line's answer as the response, before the run)") from e.__cause__
        if value < 1:
            log.warning(
                "%s scores %s line %s %g given the line's own answer as the response: fine if a response must "
                "take another form (a \\boxed{}); else check its arguments: it is called as %s(response, answer, "
                "line)",
                self.name,
                self.problems,
                problem.meta["line"],
                value,
                self.function,
            )


class _TimedOut(BaseException):
    """A reward's call interrupted by its time limit: a BaseException, as KeyboardInterrupt is, so that the
    function's own ``except Exception`` does not take it for a fault of its work and go on."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block (on the main thread) with :class:`_TimedOut` once it has run ``seconds``. A
    watchdog thread signals the main thread (SIGALRM, which also breaks a wait such as a sleep or a
    subprocess's), and again every half second after: code in the block may hold SIGALRM's handler for a
    while (math-verify's own time limits do), and the signal that finds it there is not the block's end."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("a reward of your own is called on the main thread only (its time limit is a signal)")
    main, done, expired = threading.main_thread().ident, threading.Event(), threading.Event()

    def interrupt(signum, frame):
        if expired.is_set() and not done.is_set():
            raise _TimedOut

    def watch():
        if done.wait(seconds):
            return
        expired.set()
        while True:
            signal.pthread_kill(main, signal.SIGALRM)
            if done.wait(0.5):
                return

    previous = signal.signal(signal.SIGALRM, interrupt)
    watchdog = threading.Thread(target=watch, name="reward-time-limit", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()  # before the handler goes back: a signal still on its way finds the block ended
        watchdog.join()
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


def reward_parts(spec: str) -> tuple[str, str]:
    """The file and the function of a task's ``reward``, ``FILE.py:FUNCTION`` (the file's URI may hold ``:``)."""
    source, _, function = spec.rpartition(":")
    return source, function


@functools.cache
def _loaded(reward: RewardFunction) -> Callable:
    """``reward``'s function, its file run as a module of its own (named by its digest, so that two files
    never share one): once a process, as an import is."""
    module_name = f"tracefp4_reward_{hashlib.sha256(reward.code).hexdigest()[:16]}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(module_name, loader=None))
    module.__file__ = reward.source
    sys.modules[module_name] = module  # a dataclass or pickle in the file looks its module up
    try:
        exec(compile(reward.code, reward.source, "exec"), module.__dict__)
    except SyntaxError as e:
        del sys.modules[module_name]
        raise ValueError(f"{reward.source} line {e.lineno}: {e.msg}") from None
    except (Exception, SystemExit) as e:  # a sys.exit() at the file's top level too
        del sys.modules[module_name]
        beside = (  # the file runs from its bytes, not its folder: a store's file has none
            " (a module beside the reward file is not importable: put its code in the file, or install it where "
            "the steps run)"
        ) * isinstance(e, ModuleNotFoundError)
        raise ValueError(
            f"{reward.source}: running it raised {type(e).__name__}: {e}{reward._line_of(e)}{beside}"
        ) from e
    function = getattr(module, reward.function, None)
    if not callable(function):
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name)
        raise ValueError(
            f"{reward.source} defines no function {reward.function!r} (its functions: {', '.join(defined) or 'none'})"
        )
    try:
        inspect.signature(function).bind("response", "answer", {})
    except TypeError as e:
        raise ValueError(f"{reward.name} cannot be called as {reward.function}(response, answer, line): {e}") from None
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return function


PROMPT_SLOT = "{prompt}"  # where a problem file's template puts a line's prompt


@dataclass(frozen=True)
class LineFormat:
    """How a line of a problem file gives a problem: the keys of its prompt
    and answer, a dotted path reaching into nested objects (MATH-500's
    ``problem``, verl's ``reward_model.ground_truth``), and the template the
    policy is given the prompt in (:data:`PROMPT_SLOT` replaced by it; no
    ``str.format``, whose braces would clash with a ``\\boxed{}``)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    template: str = PROMPT_SLOT


def _json_kind(value) -> str:
    """What JSON calls ``value``'s type, as an error names it."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}
    return kinds.get(type(value), "a number")


def _quoted(value) -> str:
    """``value`` as JSON, cut short: what an error quotes of a line."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _value(record: dict, path: str, where: str):
    """The value at the dotted ``path`` of ``record``: keys of objects, and item
    numbers of lists (verl's ``prompt.0.content``, its chat's first message);
    missing, an error saying what the line holds where it stopped."""
    value, keys = record, path.split(".")
    for depth, key in enumerate(keys):
        outer = ".".join(keys[:depth])
        if isinstance(value, list) and key.isascii() and key.isdigit():
            if int(key) >= len(value):
                raise ValueError(f"{where}: no {path!r} ({outer} holds {len(value)} item(s), from 0)")
            value = value[int(key)]
            continue
        if isinstance(value, list):
            raise ValueError(f"{where}: no {path!r} ({outer} is a list: name an item by its number, such as {outer}.0)")
        if not isinstance(value, dict):
            raise ValueError(f"{where}: no {path!r} ({outer} is {_json_kind(value)})")
        if key not in value:
            raise ValueError(f"{where}: no {path!r} (keys{f' of {outer}' * bool(depth)}: {', '.join(value) or 'none'})")
        value = value[key]
    return value


def read_problems(
    name: str, data: bytes, source: str, fmt: LineFormat = LineFormat(), reward: RewardFunction | None = None
) -> list[Problem]:
    """The problems of task ``name`` in ``data``, a JSON Lines file (``source``
    names it in errors): an object a line, with a prompt string and an
    answer (a string or a number; what a ``\\boxed{}`` would hold) at the
    keys ``fmt`` names, the prompt put in its template; other keys ignored,
    blank lines skipped. A prompt given twice is one problem, refused where
    its answers differ. A problem's meta holds its line and, where the
    template is not bare, its prompt as the line holds it; scored by a
    ``reward`` function, its line's object too."""
    try:
        text = data.decode("utf-8-sig")  # a byte order mark first (Windows tools write one) is no line's text
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{source} line {line}: not UTF-8 text ({e.reason} at byte {e.start} of the file)") from None
    problems: dict[str, tuple[int, Problem]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{where}: {_json_kind(record)}, not an object with {fmt.prompt_key!r} and {fmt.answer_key!r}"
            )
        prompt, answer = (_value(record, key, where) for key in (fmt.prompt_key, fmt.answer_key))
        if not isinstance(prompt, str) or not prompt.strip():
            other = " (set prompt_key to the key of the question's text)" * isinstance(prompt, (list, dict))
            raise ValueError(f"{where}: {fmt.prompt_key!r} must be a non-empty string, got {_quoted(prompt)}{other}")
        if isinstance(answer, float) and not math.isfinite(answer):  # Python's json reads NaN and Infinity
            raise ValueError(f"{where}: {fmt.answer_key!r} must be a finite number, got {answer}")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError(
                f"{where}: {fmt.answer_key!r} must be a non-empty string or a number, got {_quoted(answer)}"
            )
        meta = {"line": number} if fmt.template == PROMPT_SLOT else {"line": number, "prompt": prompt}
        if reward is not None:
            meta["record"] = record
        prompt = fmt.template.replace(PROMPT_SLOT, prompt)
        if prompt in problems:
            first, problem = problems[prompt]
            if problem.answer != answer:
                raise ValueError(
                    f"{where}: the prompt of line {first} again, with answer {answer!r} where it had {problem.answer!r}"
                )
            continue
        problems[prompt] = number, Problem(name, prompt, answer, meta, reward)
    if not problems:
        raise ValueError(f"{source}: no problems in it")
    return [problem for _, problem in problems.values()]


def check_answer_readable(problem: Problem, source: str) -> None:
    """Refuse a problem of the file ``source`` whose reference answer
    math-verify cannot read: no response would score, and RL would train on
    nothing."""
    if not parsed_answer(problem.answer):
        raise ValueError(
            f"{source} line {problem.meta['line']}: answer {problem.answer!r} is no mathematical answer "
            "(math-verify reads nothing in it), so no response would score"
        )


# -- registry ------------------------------------------------------------------

TASKS: dict[str, Task] = {task.name: task for task in (Arithmetic(), Countdown(), ProgramSynthesis())}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; expected one of {sorted(TASKS)}") from None


def solved(reward):
    """Whether a reward (or each of a tensor's) solves its problem: 1 does. Accuracy counts these alone, so
    that it means one thing for every task; a partial reward (a task's own function's) counts in RL's
    advantages, not in accuracy."""
    return reward >= 1


def reward_of(problem: Problem, response: str, finished: bool) -> float:
    """The reward of ``response`` by ``problem``'s task. A response the length
    limit cut (not ``finished``) counts up to its last complete line only: its
    last line may be an answer cut short, "357" of "3579", which the task would
    take for an answer (and RL reward, where 357 is right)."""
    if not finished:
        end = response.rfind(END)
        response = response[: end + len(END)] if end >= 0 else ""
    # a problem of no generated family is a file's (the config keeps their names apart)
    return TASKS[problem.task].reward(problem, response) if problem.task in TASKS else file_reward(problem, response)


def split(
    task: "str | Task", train_size: int, test_size: int, seed: int, difficulty: int
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and test problems, the same for the same seed: a seeded
    shuffle of all the problems drawn, then the first ``test_size`` held out.

    Not simply the first ones drawn: drawing distinct prompts is sampling
    without replacement, so the first prompts drawn are the likeliest ones
    (a countdown target that many expressions reach, such as the sum of the
    numbers). Held out first, they made the test set the head of the
    distribution and the training set its tail once the draws neared the
    number of distinct problems (countdown at difficulty 1: 2,500 of about 2,750;
    the sum answered 18% of the 500 test prompts, 6% of the 2,000 training
    ones). The price: the test set moves when ``train_size`` does."""
    task = get_task(task) if isinstance(task, str) else task
    return held_out(task.generate(test_size + train_size, seed, difficulty), task.name, test_size, seed, difficulty)


def held_out(drawn: list, name: str, test_size: int, seed: int, difficulty: int) -> tuple[list, list]:
    """The train and test parts of task ``name``'s problems ``drawn`` (or of
    anything drawn with them, one item a problem, such as their prompts) as
    :func:`split` parts them."""
    drawn = list(drawn)
    random.Random(f"{name}/{difficulty}/{seed}/split").shuffle(drawn)
    return drawn[test_size:], drawn[:test_size]
