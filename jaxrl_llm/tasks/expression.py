"""A tiny, safe arithmetic expression parser (Countdown, arithmetic). Never `eval`.

Grammar (recursive descent, exact rational arithmetic with `fractions.Fraction`):

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := ('+' | '-') factor | NUMBER | '(' expr ')'

Input length and nesting depth are bounded so adversarial strings cost O(limit).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

MAX_CHARS = 256
MAX_DEPTH = 32
_OPS = "+-*/()"
_ALIASES = {"×": "*", "x": "*", "÷": "/", "−": "-", "–": "-"}


class ExpressionError(ValueError):
    """The text is not a well-formed arithmetic expression (or divides by zero)."""


@dataclasses.dataclass(frozen=True)
class Parsed:
    value: Fraction
    numbers: tuple[int, ...]  # integer literals in order of appearance


def _tokenize(text: str) -> list[str]:
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"expression longer than {MAX_CHARS} characters")
    tokens: list[str] = []
    i = 0
    while i < len(text):
        c = _ALIASES.get(text[i], text[i])
        if c.isspace():
            i += 1
        elif c in _OPS:
            tokens.append(c)
            i += 1
        elif c.isdecimal():
            # isdecimal, not isdigit: '²' is a digit that int() rejects; fullwidth '１' is fine.
            j = i
            while j < len(text) and text[j].isdecimal():
                j += 1
            tokens.append(text[i:j])
            i = j
        else:
            raise ExpressionError(f"unexpected character {text[i]!r} at position {i}")
    if not tokens:
        raise ExpressionError("empty expression")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.factor(depth)
            if op == "*":
                value = value * rhs
            else:
                if rhs == 0:
                    raise ExpressionError("division by zero")
                value = value / rhs
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ExpressionError(f"nesting deeper than {MAX_DEPTH}")
        token = self.peek()
        if token is None:
            raise ExpressionError("expression ends early")
        if token in ("+", "-"):
            self.take()
            inner = self.factor(depth + 1)
            return inner if token == "+" else -inner
        if token == "(":
            self.take()
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise ExpressionError("missing ')'")
            self.take()
            return value
        if token.isdecimal():
            self.take()
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise ExpressionError(f"unexpected {token!r}")


def parse_expression(text: str) -> Parsed:
    """Evaluate `text` exactly; raise `ExpressionError` if it is not a valid expression."""
    parser = _Parser(_tokenize(text))
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after a complete expression")
    return Parsed(value=value, numbers=tuple(parser.numbers))
