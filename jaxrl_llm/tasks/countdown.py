"""`countdown` (TinyZero prompt format, as in the TOPR-on-Countdown set-up): reach a target from given numbers with + - * /.

Reward (TOPR §4.1, FPA App. B.1): a format term (+1 when the completion has an `<answer>…</answer>` block,
−1 otherwise) plus a validity term (+1 when the answer's equation uses each given number
exactly once — or at most once with `use_all=False` — and evaluates to the target, −1
otherwise); so rewards lie in {−2, 0, 2}. `reward_scheme="01"` gives 1 for a valid equation,
else 0. The equation is parsed by `tasks.expression` (exact rationals; never `eval`).
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

from jaxrl_llm.tasks.base import Problem, RewardResult, RewardScheme, Task
from jaxrl_llm.tasks.expression import ExpressionError, parse_expression
from jaxrl_llm.tasks.loading import load_rows

_OPEN, _CLOSE = "<answer>", "</answer>"


def extract_answer_block(text: str) -> str | None:
    """Content of the last complete `<answer>…</answer>` block (linear time)."""
    end = text.rfind(_CLOSE)
    if end < 0:
        return None
    start = text.rfind(_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(_OPEN) : end].strip()


def _random_solution(rng: random.Random, numbers: list[int]) -> tuple[str, Fraction, list[str]]:
    """Combine all numbers in a random order with random ops; return (expr, value, steps)."""
    order = numbers[:]
    rng.shuffle(order)
    expr, value, steps = str(order[0]), Fraction(order[0]), []
    for n in order[1:]:
        op = rng.choice("+-*/")
        if op == "/" and (n == 0 or (value / n).denominator != 1):
            op = "+"
        new = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
        steps.append(f"{value} {op} {n} = {new}")
        expr, value = f"({expr}) {op} {n}" if expr != str(order[0]) else f"{expr} {op} {n}", new
    return expr, value, steps


class CountdownTask(Task):
    name = "countdown"
    reward_fn = "format ±1 + validity ±1 (each number used once, equals target)"

    def __init__(
        self,
        *,
        path: str | None = None,
        min_numbers: int = 3,
        max_numbers: int = 4,
        max_number: int = 99,
        max_target: int = 100,
        use_all: bool = True,
        reward_scheme: RewardScheme = "pm1",
    ) -> None:
        super().__init__(reward_scheme=reward_scheme)
        self.path = path
        self.min_numbers, self.max_numbers = min_numbers, max_numbers
        self.max_number, self.max_target = max_number, max_target
        self.use_all = use_all

    def make_problem(self, index: int, *, split: str = "train", seed: int = 0) -> Problem:
        rng = random.Random(f"countdown-{seed}-{split}-{index}")
        while True:  # rejection-sample a positive integer target in range
            numbers = [rng.randint(1, self.max_number) for _ in range(rng.randint(self.min_numbers, self.max_numbers))]
            expr, value, steps = _random_solution(rng, numbers)
            if value.denominator == 1 and 1 <= value <= self.max_target:
                break
        return self._problem(f"countdown-{split}-{seed}-{index}", numbers, int(value), expr, steps)

    def _problem(self, pid: str, numbers: list[int], target: int, expr: str | None, steps: list[str] | None) -> Problem:
        solution = None
        if expr is not None:
            solution = f"<think>{', '.join(steps or [])}</think>\n{_OPEN} {expr} {_CLOSE}"
        return Problem(
            id=pid,
            question=f"Using the numbers {numbers}, create an equation that equals {target}.",
            answer=str(target),
            solution=solution,
            metadata={"numbers": numbers, "target": target},
        )

    def load(self, *, split: str = "train", num: int | None = None, seed: int = 0) -> list[Problem]:
        if self.path is None:
            return [self.make_problem(i, split=split, seed=seed) for i in range(num or 256)]
        problems = []
        for i, row in enumerate(load_rows(self.path, split=split)):
            try:
                numbers, target = [int(n) for n in row["nums"]], int(row["target"])
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{self.path} row {i}: need 'nums' (ints) and 'target' ({err})") from err
            problems.append(self._problem(f"countdown-{i}", numbers, target, None, None))
        return problems[:num] if num else problems

    def prompt(self, problem: Problem) -> str:
        numbers, target = problem.metadata["numbers"], problem.metadata["target"]
        return (
            f"Using the numbers {numbers}, create an equation that equals {target}. You can use "
            "basic arithmetic operations (+, -, *, /) and each number can only be used once. "
            f"Show your work in <think> </think> tags. And return the final answer in {_OPEN} "
            f"{_CLOSE} tags, for example {_OPEN} (1 + 2) / 3 {_CLOSE}.\n<think>"
        )

    def check_equation(self, equation: str, numbers: list[int], target: int) -> tuple[bool, str]:
        """(valid, reason) for an equation against the puzzle."""
        try:
            parsed = parse_expression(equation)
        except ExpressionError as err:
            return False, f"parse error: {err}"
        used, given = Counter(parsed.numbers), Counter(numbers)
        if any(used[n] > given[n] for n in used):
            return False, "a number is used more often than given"
        if self.use_all and used != given:
            return False, "not every number is used"
        if parsed.value != target:
            return False, f"evaluates to {parsed.value}, not {target}"
        return True, "ok"

    def score(self, problem: Problem, completion: str) -> RewardResult:
        block = extract_answer_block(completion)
        # Countdown models write "(1 + 2) / 3" or "(1 + 2) / 3 = 1": keep only the left-hand side.
        equation = block.split("=", 1)[0] if block is not None else None
        valid, reason = (False, "no <answer> block") if equation is None else self.check_equation(
            equation, problem.metadata["numbers"], problem.metadata["target"]
        )
        if self.reward_scheme == "01":
            reward = 1.0 if valid else 0.0
        else:
            reward = (1.0 if block is not None else -1.0) + (1.0 if valid else -1.0)
        return RewardResult(reward, valid, block is None, block, {"reason": reason})
