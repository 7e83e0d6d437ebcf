"""A tiny pipeline language over integers and integer lists, for the
program-synthesis task: the policy writes a program, tracefp4 runs it here.

Model output is never handed to Python (no ``exec``/``eval``): the source is
lexed character by character over an ASCII alphabet, parsed into stages and
interpreted, with every resource bounded (source length, nesting depth,
steps, integer magnitude, list length), so ``run`` is total and deterministic
and raises only :class:`ProgramError`.

A program is stages joined by ``|``, each applied to the previous value::

    program  := stage ('|' stage)*
    stage    := OP INT                   x OP n, OP one of + - * / % > < =
              | 'take' INT | 'drop' INT  first n / all but the first n elements
              | ('map' | 'filter') stage stage applied to each element / kept where nonzero
              | WORD                     sq neg abs even odd range | sum len max min head last sort rev
              | '(' program ')'
    INT      := '-'? [0-9]+

``/`` and ``%`` are floor division and modulo; comparisons and ``even``/``odd``
give 1 or 0; ``range`` turns n into [0, 1, ..., n-1]. For example
``filter odd | map sq | sum`` takes [1, 2, 3] to 10.
"""

import functools
from dataclasses import dataclass

MAX_CHARS = 512  # source length
MAX_DEPTH = 8  # nesting of map/filter/parentheses
MAX_STEPS = 1000  # stage applications per run
MAX_INT = 10**12  # every integer stays strictly inside +-MAX_INT
MAX_LEN = 64  # list length

_DIGITS = "0123456789"
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
_OPS = frozenset("+-*/%><=")
_PUNCT = frozenset("|()")
_SPACE = " \t"

INT_OPS = {"sq", "neg", "abs", "even", "odd", "range"}  # take an int
LIST_OPS = {"sum", "len", "max", "min", "head", "last", "sort", "rev"}  # take a list
COUNT_OPS = {"take", "drop"}  # take a list and an INT argument
HIGHER_OPS = {"map", "filter"}  # take a list and a stage


class ProgramError(ValueError):
    """A program that cannot be parsed or run: says where and what."""


@dataclass(frozen=True)
class Stage:
    """One parsed stage: ``op`` is an operator, a word, or ``(`` for a group."""

    op: str
    pos: int
    arg: int | None = None
    body: "tuple[Stage, ...]" = ()


def _lex(source: str) -> list[tuple[str, int]]:
    """Split into (token, position); only ASCII is known, so unicode digits,
    letters or spaces can never pass as something else."""
    tokens, i = [], 0
    while i < len(source):
        c = source[i]
        if c in _SPACE:
            i += 1
            continue
        start = i
        for charset in (_DIGITS, _LETTERS):
            if c in charset:
                while i < len(source) and source[i] in charset:
                    i += 1
                break
        else:
            if c not in _OPS and c not in _PUNCT:
                raise ProgramError(f"position {i}: unknown character {c!r}")
            i += 1
        tokens.append((source[start:i], start))
    return tokens


class _Parser:
    def __init__(self, source: str):
        self.tokens = _lex(source)
        self.i = 0
        self.end = len(source)

    def peek(self) -> str | None:
        return self.tokens[self.i][0] if self.i < len(self.tokens) else None

    def next(self, expected: str) -> tuple[str, int]:
        if self.i == len(self.tokens):
            raise ProgramError(f"position {self.end}: expected {expected}, found the end of the program")
        self.i += 1
        return self.tokens[self.i - 1]

    def program(self, depth: int) -> tuple[Stage, ...]:
        stages = [self.stage(depth)]
        while self.peek() == "|":
            self.i += 1
            stages.append(self.stage(depth))
        return tuple(stages)

    def stage(self, depth: int) -> Stage:
        tok, pos = self.next("a stage")
        if depth > MAX_DEPTH:
            raise ProgramError(f"position {pos}: nested deeper than {MAX_DEPTH}")
        if tok == "(":
            body = self.program(depth + 1)
            close, close_pos = self.next("')'")
            if close != ")":
                raise ProgramError(f"position {close_pos}: expected ')', found {close!r}")
            return Stage("(", pos, body=body)
        if tok in _OPS:
            return Stage(tok, pos, arg=self.integer())
        if tok in INT_OPS or tok in LIST_OPS:
            return Stage(tok, pos)
        if tok in COUNT_OPS:
            return Stage(tok, pos, arg=self.integer())
        if tok in HIGHER_OPS:
            return Stage(tok, pos, body=(self.stage(depth + 1),))
        if tok[0] in _LETTERS:
            raise ProgramError(f"position {pos}: unknown word {tok[:20]!r}")
        raise ProgramError(f"position {pos}: expected a stage, found {tok[:20]!r}")

    def integer(self) -> int:
        tok, pos = self.next("a number")
        sign = 1
        if tok == "-":
            sign = -1
            tok, _ = self.next("a number")
        if tok[0] not in _DIGITS:
            raise ProgramError(f"position {pos}: expected a number, found {tok[:20]!r}")
        if len(tok) > len(str(MAX_INT)) or int(tok) >= MAX_INT:
            raise ProgramError(f"position {pos}: number {tok[:20]}... is not below {MAX_INT}")
        return sign * int(tok)


def parse(source: str) -> tuple[Stage, ...]:
    """The stages of ``source``; ProgramError names the position of a problem."""
    if not isinstance(source, str):
        raise ProgramError(f"a program is a str, not {type(source).__name__}")
    return _parsed(source)


@functools.lru_cache(maxsize=1024)
def _parsed(source: str) -> tuple[Stage, ...]:
    """:func:`parse`, kept (its stages are immutable): drawing a program task's
    problem runs each candidate program on every example input."""
    if len(source) > MAX_CHARS:
        raise ProgramError(f"program of {len(source)} characters; the limit is {MAX_CHARS}")
    parser = _Parser(source)
    if not parser.tokens:
        raise ProgramError("empty program")
    stages = parser.program(0)
    if parser.peek() is not None:
        tok, pos = parser.tokens[parser.i]
        raise ProgramError(f"position {pos}: unexpected {tok[:20]!r}")
    return stages


def check_value(value) -> "int | list[int]":
    """``value`` as the language sees it (a tuple becomes a list); ProgramError
    if it is not an int or a list of ints within the bounds."""
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_LEN:
            raise ProgramError(f"list of {len(value)} elements; the limit is {MAX_LEN}")
        if any(isinstance(x, (list, tuple)) for x in value):
            raise ProgramError("lists hold ints only")
        return [check_value(x) for x in value]
    if type(value) is not int:
        raise ProgramError(f"values are ints or lists of ints, not {type(value).__name__}")
    if abs(value) >= MAX_INT:
        raise ProgramError(f"integer beyond +-{MAX_INT}")
    return value


def format_value(value: "int | list[int]") -> str:
    """Compact text of a value, as the task prompts show it: ``7``, ``[1,-2,3]``."""
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


class Machine:
    """Runs parsed programs, counting steps (one per stage application) against
    ``max_steps``; ``steps`` never exceeds it."""

    def __init__(self, max_steps: int = MAX_STEPS):
        self.max_steps = max_steps
        self.steps = 0

    def run(self, program: str, value) -> "int | list[int]":
        value = check_value(value)
        for stage in parse(program):
            value = self.apply(stage, value)
        return value

    def apply(self, s: Stage, x):
        if self.steps >= self.max_steps:
            raise ProgramError(f"position {s.pos}: step budget of {self.max_steps} exceeded")
        self.steps += 1
        if s.op == "(":
            for inner in s.body:
                x = self.apply(inner, x)
            return x
        if s.op in _OPS or s.op in INT_OPS:
            return self._int_op(s, _expect(s, x, int))
        xs = _expect(s, x, list)
        if s.op == "map":
            return [self._element(s, v) for v in xs]
        if s.op == "filter":
            return [v for v in xs if self._element(s, v) != 0]
        if s.op in COUNT_OPS:
            if s.arg < 0:
                raise ProgramError(f"position {s.pos}: '{s.op}' needs a count >= 0, got {s.arg}")
            return xs[: s.arg] if s.op == "take" else xs[s.arg :]
        if s.op == "sum":
            return _bounded(s, sum(xs))
        if s.op == "len":
            return len(xs)
        if s.op == "sort":
            return sorted(xs)
        if s.op == "rev":
            return xs[::-1]
        if not xs:
            raise ProgramError(f"position {s.pos}: '{s.op}' of an empty list")
        return {"max": max, "min": min, "head": lambda v: v[0], "last": lambda v: v[-1]}[s.op](xs)

    def _element(self, s: Stage, v: int) -> int:
        """The body of map/filter applied to one element; lists stay flat."""
        y = self.apply(s.body[0], v)
        if not isinstance(y, int):
            raise ProgramError(f"position {s.pos}: the stage under '{s.op}' must give an int, not a list")
        return y

    def _int_op(self, s: Stage, x: int):
        n = s.arg
        if s.op in ("/", "%") and n == 0:
            raise ProgramError(f"position {s.pos}: division by zero")
        if s.op == "range":
            if not 0 <= x <= MAX_LEN:
                raise ProgramError(f"position {s.pos}: 'range' of {x}; it needs 0..{MAX_LEN}")
            return list(range(x))
        ops = {
            "+": lambda: x + n,
            "-": lambda: x - n,
            "*": lambda: x * n,
            "/": lambda: x // n,
            "%": lambda: x % n,
            ">": lambda: int(x > n),
            "<": lambda: int(x < n),
            "=": lambda: int(x == n),
            "sq": lambda: x * x,
            "neg": lambda: -x,
            "abs": lambda: abs(x),
            "even": lambda: int(x % 2 == 0),
            "odd": lambda: int(x % 2 == 1),
        }
        return _bounded(s, ops[s.op]())


def _expect(s: Stage, x, kind: type):
    if not isinstance(x, kind):
        want, got = ("a list", "an int") if kind is list else ("an int", "a list")
        raise ProgramError(f"position {s.pos}: '{s.op}' expects {want}, got {got}")
    return x


def _bounded(s: Stage, x: int) -> int:
    if abs(x) >= MAX_INT:
        raise ProgramError(f"position {s.pos}: '{s.op}' leaves the integer range +-{MAX_INT}")
    return x


def run(program: str, value, max_steps: int = MAX_STEPS) -> "int | list[int]":
    """Run ``program`` on ``value`` (an int or a list of ints) within ``max_steps``."""
    return Machine(max_steps).run(program, value)
