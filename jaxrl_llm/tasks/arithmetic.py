"""`arithmetic`: generated multi-step integer expressions with known answers (any size, seeded).

Each problem is a random expression tree over small integers and `+ - *`; the gold solution
reduces it one operation at a time ("3 + 4 = 7") and ends with "The answer is N." (the GSM8K
answer format of TOPR arXiv:2503.14286, so the same extraction applies). Problem i of a split depends only on
(seed, split, i), so datasets of any size are reproducible and nested.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from jaxrl_llm.tasks.answers import MAGIC, answer_after_magic, numbers_equal
from jaxrl_llm.tasks.base import Problem, RewardResult, RewardScheme, Task, binary_reward

_OPS = ("+", "-", "*")


@dataclass(frozen=True)
class _Node:
    op: str
    left: _Node | int
    right: _Node | int


Expr = _Node | int


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def evaluate(expr: Expr) -> int:
    if isinstance(expr, int):
        return expr
    return _apply(expr.op, evaluate(expr.left), evaluate(expr.right))


def render(expr: Expr, *, top: bool = True) -> str:
    if isinstance(expr, int):
        return str(expr) if expr >= 0 else f"({expr})"
    text = f"{render(expr.left, top=False)} {expr.op} {render(expr.right, top=False)}"
    return text if top else f"({text})"


def _random_expr(rng: random.Random, num_ops: int, max_operand: int) -> Expr:
    if num_ops == 0:
        return rng.randint(1, max_operand)
    left_ops = rng.randint(0, num_ops - 1)
    op = rng.choice(_OPS)
    left = _random_expr(rng, left_ops, max_operand)
    right = _random_expr(rng, num_ops - 1 - left_ops, max_operand)
    if op == "*" and not (isinstance(left, int) or isinstance(right, int)):
        op = "+"  # keep products of two sub-expressions out: answers stay small
    return _Node(op, left, right)


def solution_steps(expr: Expr) -> list[str]:
    """Reduce the leftmost innermost operation until one number remains."""
    steps: list[str] = []

    def reduce_once(e: Expr) -> Expr:
        if isinstance(e, int):
            return e
        if isinstance(e.left, int) and isinstance(e.right, int):
            value = _apply(e.op, e.left, e.right)
            steps.append(f"{render(e.left, top=False)} {e.op} {render(e.right, top=False)} = {value}")
            return value
        if not isinstance(e.left, int):
            return _Node(e.op, reduce_once(e.left), e.right)
        return _Node(e.op, e.left, reduce_once(e.right))

    while not isinstance(expr, int):
        expr = reduce_once(expr)
    return steps


class ArithmeticTask(Task):
    name = "arithmetic"
    reward_fn = "±1: number after the last 'The answer is' equals the expression's value"

    def __init__(
        self,
        *,
        min_ops: int = 2,
        max_ops: int = 4,
        max_operand: int = 20,
        reward_scheme: RewardScheme = "pm1",
    ) -> None:
        super().__init__(reward_scheme=reward_scheme)
        if not 1 <= min_ops <= max_ops:
            raise ValueError(f"need 1 <= min_ops <= max_ops, got {min_ops}, {max_ops}")
        self.min_ops, self.max_ops, self.max_operand = min_ops, max_ops, max_operand

    def make_problem(self, index: int, *, split: str = "train", seed: int = 0) -> Problem:
        rng = random.Random(f"arithmetic-{seed}-{split}-{index}")  # str seeds hash stably
        expr = _random_expr(rng, rng.randint(self.min_ops, self.max_ops), self.max_operand)
        value = evaluate(expr)
        steps = solution_steps(expr)
        solution = "\n".join(steps) + f"\n{MAGIC} {value}."
        return Problem(
            id=f"arithmetic-{split}-{seed}-{index}",
            question=f"What is {render(expr)}?",
            answer=str(value),
            solution=solution,
            metadata={"num_ops": len(steps)},
        )

    def load(self, *, split: str = "train", num: int | None = None, seed: int = 0) -> list[Problem]:
        return [self.make_problem(i, split=split, seed=seed) for i in range(num or 256)]

    def prompt(self, problem: Problem) -> str:
        return (
            f"Question: {problem.question}\nWork it out one step at a time and finish with "
            f"'{MAGIC} N.'\nAnswer:\n"
        )

    def score(self, problem: Problem, completion: str) -> RewardResult:
        answer = answer_after_magic(completion)
        if answer is None:
            return RewardResult(binary_reward(False, self.reward_scheme), False, True, None)
        correct = numbers_equal(answer, problem.answer)
        return RewardResult(binary_reward(correct, self.reward_scheme), correct, False, answer)
