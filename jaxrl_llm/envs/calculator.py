"""`calculator`: a task (arithmetic, gsm8k, ...) answered with a calculator tool.

The tool evaluates model text safely: it is parsed with `ast.parse(mode="eval")` (parsing
runs nothing) and only a whitelist of nodes is walked — number literals, + - * / // % **,
unary signs, parentheses — in exact rational arithmetic (`fractions.Fraction`). Never `eval`
or `exec`. Input length, nesting depth, exponents and the size of every intermediate value are
bounded, so `9**9**9` or a megabyte of digits is an error message, not a stalled trainer.
"""

from __future__ import annotations

import ast
import math
from decimal import Decimal, localcontext
from fractions import Fraction

from jaxrl_llm.envs.tool_env import ToolEnvironment
from jaxrl_llm.envs.tools import Tool, ToolCallError, tool

MAX_CHARS = 200  # longer expressions are refused before parsing
MAX_DEPTH = 40  # nested operations
MAX_EXPONENT = 1_000  # |exponent| of **
MAX_BITS = 4_096  # numerator and denominator of every intermediate value
DIGITS = 12  # significant digits of a non-integer result


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is what the model reads."""


_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
           ast.Mod: "%", ast.Pow: "**"}


def _bounded(value: Fraction) -> Fraction:
    if max(abs(value.numerator).bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError(f"a value exceeds {MAX_BITS} bits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only integer exponents are supported")
    e = int(exponent)
    if abs(e) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {e} is larger than {MAX_EXPONENT}")
    size = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if size * abs(e) > MAX_BITS:  # checked before computing: 9**9**9 is never built
        raise CalculatorError(f"the result would exceed {MAX_BITS} bits")
    if base == 0 and e < 0:
        raise CalculatorError("division by zero")
    return base**e


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op in ("/", "//", "%") and b == 0:
        raise CalculatorError("division by zero")
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a / b
    if op == "//":
        return Fraction(a // b)
    if op == "%":
        return a % b
    return _power(a, b)


def _walk(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"nesting deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalculatorError("numbers must be finite")
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _walk(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left, depth + 1), _walk(node.right, depth + 1)
        return _bounded(_apply(_BINARY[type(node.op)], left, right))
    raise CalculatorError(f"unsupported syntax: {type(node).__name__} (numbers, + - * / // % ** "
                          "and parentheses only)")


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; `CalculatorError` for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-").replace(
        "^", "**")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    if not text:
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")  # parses only; nothing is run
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise CalculatorError(f"not an arithmetic expression ({type(err).__name__})") from err
    return _walk(tree.body, 0)


def format_value(value: Fraction) -> str:
    """An integer as is; otherwise a decimal of `DIGITS` significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    with localcontext() as ctx:
        ctx.prec = DIGITS
        text = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 4 / 7".
    """
    try:
        return format_value(evaluate(expression))
    except CalculatorError as err:
        raise ToolCallError(f"calculator: {err}") from err


CALCULATOR: Tool = tool(calculator)


class CalculatorEnv(ToolEnvironment):
    """The task's problems, with the `calculator` tool (env.name: calculator)."""

    name = "calculator"
    max_turns = 4
    instructions = ("You can call the calculator tool for arithmetic. When you know the final "
                    "answer, reply with it in the format asked for and no tool call.")

    def default_tools(self) -> list[Tool]:
        return [CALCULATOR]
