"""`gsm8k` (TOPR arXiv:2503.14286 §4.1): grade-school word problems, 8-shot chain-of-thought prompt.

The answer is the number after the magic string "The answer is" (missing -> invalid, reward
−1); compared numerically after removing commas, `$` and a trailing period (TOPR §4.1, FPA App. B.1). Rows
are GSM8K-style `{"question": ..., "answer": "steps ... #### 42"}` from a local JSONL/Parquet
file or `hf://openai/gsm8k:main` when online. The eight exemplars below are our own problems
written in the format of Wang et al. (2022)'s prompt, not copied from any dataset.

Options (`data.task_options`, docs/tasks.md): `num_shots` (0–8; 0 states the answer format
with one short worked example instead of the exemplars: ~600 fewer prompt tokens) and
`answer_format` ("The answer is", or "####" — GSM8K's own `#### N` line, for models trained on
GSM8K-style solutions; exemplars, gold solutions and the grader all follow it).
"""

from __future__ import annotations

import re
from importlib import resources

from jaxrl_llm.tasks.answers import MAGIC, answer_after_magic, normalize_number, numbers_equal
from jaxrl_llm.tasks.base import Problem, RewardResult, RewardScheme, Task, binary_reward
from jaxrl_llm.tasks.loading import load_rows, require

EXEMPLARS: tuple[tuple[str, str], ...] = (
    ("A baker fills 6 trays with 12 rolls each and sells 50 rolls. How many rolls are left?",
     "The baker makes 6 * 12 = 72 rolls. After selling 50, 72 - 50 = 22 are left. The answer is 22."),
    ("Mia reads 15 pages a day for 4 days and then 20 pages on the fifth day. How many pages did she read?",
     "In four days she reads 15 * 4 = 60 pages. Adding the fifth day gives 60 + 20 = 80. The answer is 80."),
    ("A bus holds 40 people. 3 buses are full and a fourth has 17 people. How many people are riding?",
     "Three full buses carry 3 * 40 = 120 people. With the fourth, 120 + 17 = 137. The answer is 137."),
    ("Tom has $90. He buys 4 books at $12 each. How much money does he have left?",
     "The books cost 4 * 12 = 48 dollars. He has 90 - 48 = 42 dollars left. The answer is 42."),
    ("A garden has 8 rows of 9 tulips. A rabbit eats 11 tulips. How many tulips remain?",
     "There are 8 * 9 = 72 tulips. After the rabbit, 72 - 11 = 61 remain. The answer is 61."),
    ("Sara splits 96 stickers equally among 8 friends and keeps none. How many stickers does each friend get?",
     "Each friend gets 96 / 8 = 12 stickers. The answer is 12."),
    ("A shop sold 1,250 pens on Monday and twice as many on Tuesday. How many pens were sold in both days?",
     "On Tuesday it sold 2 * 1250 = 2500 pens. Together 1250 + 2500 = 3750 pens. The answer is 3750."),
    ("Leo runs 3 km every morning and 2 km every evening. How many km does he run in a week?",
     "Each day he runs 3 + 2 = 5 km. In 7 days that is 5 * 7 = 35 km. The answer is 35."),
)

_CALC = re.compile(r"<<[^<>]{0,200}>>")  # GSM8K calculator annotations "<<6*12=72>>"
TINY_ASSET = "gsm8k_tiny.jsonl"


HASH = "####"  # GSM8K's own final-answer line
ANSWER_FORMATS = (MAGIC, HASH)


def _final(marker: str, number: str) -> str:
    """The closing words of a solution in `marker`'s format."""
    return f"{MAGIC} {number}." if marker == MAGIC else f"{HASH} {number}"


# The zero-shot prompt's one worked example: asked for "#### N" without one, the packaged
# SmolLM2-135M-Instruct wrote the letter N, "A: 64" or nothing (docs/benchmarks.md § Zero-shot
# GSM8K prompt wording measures the wordings). Its question is no exemplar's, its answer is 2 + 3 = 5.
EXAMPLE_QUESTION = "Tom has 2 apples and buys 3 more. How many apples does he have?"
EXAMPLE_STEPS, EXAMPLE_ANSWER = "Tom has 2 + 3 = 5 apples.", "5"


def zero_shot_instruction(marker: str = MAGIC) -> str:
    """What precedes the question at `num_shots: 0`: the format, and one worked example
    that ends in `marker`'s answer line."""
    return ("Solve the problem step by step. End with the final answer on its own line, as in "
            f"this example.\n\nQ: {EXAMPLE_QUESTION}\n"
            f"A: {EXAMPLE_STEPS}\n{_final(marker, EXAMPLE_ANSWER)}\n")


def few_shot_prefix(k: int = 8, marker: str = MAGIC) -> str:
    """The first `k` exemplars, each closing in `marker`'s format."""
    def closed(answer: str) -> str:
        steps, _, number = answer.rpartition(f" {MAGIC} ")
        return f"{steps} {_final(marker, number.rstrip('.'))}"

    return "".join(f"Q: {q}\nA: {closed(a)}\n\n" for q, a in EXEMPLARS[:k])


def parse_gsm8k_answer(text: str, where: str, marker: str = MAGIC) -> tuple[str, str]:
    """GSM8K 'steps #### 42' -> (gold number, step-by-step solution ending in `marker`'s
    format: "The answer is 42." or "#### 42")."""
    steps, sep, final = text.rpartition("####")
    value = normalize_number(final) if sep else None
    if value is None:
        raise ValueError(f"{where}: answer has no '#### <number>' line: {text[-80:]!r}")
    number = answer_after_magic(f"{MAGIC} {final.strip()}") or final.strip()
    solution = " ".join(_CALC.sub("", steps).split())
    return number, f"{solution} {_final(marker, number)}"


class GSM8KTask(Task):
    name = "gsm8k"
    reward_fn = "±1: number after the last 'The answer is' equals the gold; missing -> invalid"

    def __init__(self, *, path: str | None = None, num_shots: int = 8, answer_format: str = MAGIC,
                 reward_scheme: RewardScheme = "pm1") -> None:
        super().__init__(reward_scheme=reward_scheme)
        if not 0 <= num_shots <= len(EXEMPLARS):
            raise ValueError(f"num_shots must be in [0, {len(EXEMPLARS)}], got {num_shots}")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {list(ANSWER_FORMATS)}, got "
                             f"{answer_format!r}")
        self.path, self.num_shots, self.answer_format = path, num_shots, answer_format
        self._prefix = few_shot_prefix(num_shots, answer_format)
        self.reward_fn = (f"±1: number after the last {answer_format!r} equals the gold; "
                          "missing -> invalid")

    def load(self, *, split: str = "train", num: int | None = None, seed: int = 0) -> list[Problem]:
        path = self.path or str(resources.files("jaxrl_llm.assets") / TINY_ASSET)
        problems = []
        for i, row in enumerate(load_rows(path, split=split)):
            where = f"{path} row {i}"
            gold, solution = parse_gsm8k_answer(str(require(row, "answer", where)), where,
                                                self.answer_format)
            problems.append(Problem(id=f"gsm8k-{split}-{i}", question=str(require(row, "question", where)),
                                    answer=gold, solution=solution))
        return problems[:num] if num else problems

    def prompt(self, problem: Problem) -> str:
        if self.num_shots == 0:  # no exemplar shows the format: say it
            return f"{zero_shot_instruction(self.answer_format)}\nQ: {problem.question}\nA:"
        return f"{self._prefix}Q: {problem.question}\nA:"

    def gold_completion(self, problem: Problem) -> str | None:
        return f" {problem.solution}" if problem.solution else None

    def score(self, problem: Problem, completion: str) -> RewardResult:
        # Few-shot models keep writing "Q: ..." after answering: score only the first answer.
        completion = completion.split("\nQ:", 1)[0]
        answer = answer_after_magic(completion, self.answer_format)
        if answer is None:
            return RewardResult(binary_reward(False, self.reward_scheme), False, True, None)
        correct = numbers_equal(answer, problem.answer)
        return RewardResult(binary_reward(correct, self.reward_scheme), correct, False, answer)
