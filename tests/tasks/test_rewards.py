"""Reward functions on tricky strings (SPEC §8): extraction, number normalisation, Countdown."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from jaxrl_llm.tasks import get_task, task_names
from jaxrl_llm.tasks.answers import answer_after_magic, last_boxed
from jaxrl_llm.tasks.base import Problem
from jaxrl_llm.tasks.expression import ExpressionError, parse_expression
from jaxrl_llm.tasks.verify import parse_verdict


def test_registry_lists_the_tasks():
    assert set(task_names()) >= {"arithmetic", "countdown", "gsm8k", "math", "verify"}
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        get_task("nope")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So 3 + 4 = 7. The answer is 7.", "7"),
        ("The answer is 1,234.", "1234"),
        ("The answer is $5.00", "5"),
        ("the answer is -7 apples", "-7"),
        ("The answer is 12.50.", "12.5"),
        ("The answer is 3. Wait. The answer is 4.", "4"),  # the last occurrence counts
        ("I think 42.", None),  # magic string missing -> invalid
        ("The answer is", None),
        ("The answer is\n42", None),  # the number must be on the same line
        ("The answer is unknown", None),
    ],
)
def test_answer_after_magic(text, expected):
    assert answer_after_magic(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{5}.", "5"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{a{b{c}}d} then \\boxed{\\sqrt{2}}", "\\sqrt{2}"),  # the last box
        ("\\boxed{x^{2}+1", None),  # unbalanced
        ("\\boxed{1} and \\boxed{2", "1"),  # last *complete* box
        ("The final answer is \\boxed 7.", "7."),
        ("\\fbox{3}", "3"),
        ("no box here", None),
        ("\\boxed{1,000}", "1,000"),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text, value, numbers",
    [
        ("(1 + 2) / 3", Fraction(1), (1, 2, 3)),
        ("2 * 3 + 4", Fraction(10), (2, 3, 4)),
        ("2 * (3 + 4)", Fraction(14), (2, 3, 4)),
        ("-3 + 10 - 2", Fraction(5), (3, 10, 2)),
        ("7 / 2", Fraction(7, 2), (7, 2)),
        ("8 × 2 ÷ 4", Fraction(4), (8, 2, 4)),
    ],
)
def test_expression_parser_values(text, value, numbers):
    parsed = parse_expression(text)
    assert parsed.value == value and parsed.numbers == numbers


@pytest.mark.parametrize("text", ["__import__('os')", "1 +", "(1 + 2", "1 / 0", "2 ** 3", "1 2", "", "(" * 40 + "1" + ")" * 40])
def test_expression_parser_rejects(text):
    with pytest.raises(ExpressionError):
        parse_expression(text)


COUNTDOWN = Problem(id="c", question="", answer="26", metadata={"numbers": [3, 5, 7], "target": 26})


@pytest.mark.parametrize(
    "completion, reward, correct, invalid",
    [
        ("<think>3*7=21</think><answer> 3 * 7 + 5 </answer>", 2.0, True, False),
        ("<answer>(7 * 3) + 5 = 26</answer>", 2.0, True, False),
        ("<answer>5 + 7 * 3</answer>", 2.0, True, False),
        ("<answer>3 * 7 + 5 + 0</answer>", 0.0, False, False),  # 0 is not a given number
        ("<answer>7 * 3 + 5 - 3 + 3</answer>", 0.0, False, False),  # 3 reused
        ("<answer>7 * 5 - 3 * 3</answer>", 0.0, False, False),  # reuse reaching the target
        ("<answer>3 * 7</answer>", 0.0, False, False),  # 5 unused
        ("<answer>eval('26')</answer>", 0.0, False, False),  # not an expression
        ("<answer>7 / (5 - 5)</answer>", 0.0, False, False),  # division by zero, reuse
        ("3 * 7 + 5", -2.0, False, True),  # no answer block
        ("<answer>3 * 7 + 5", -2.0, False, True),  # unclosed
    ],
)
def test_countdown_reward(completion, reward, correct, invalid):
    result = get_task("countdown").score(COUNTDOWN, completion)
    assert (result.reward, result.correct, result.invalid) == (reward, correct, invalid)


def test_countdown_at_most_once_mode_and_01_scheme():
    task = get_task("countdown", use_all=False, reward_scheme="01")
    problem = Problem(id="c", question="", answer="21", metadata={"numbers": [3, 5, 7], "target": 21})
    assert task.score(problem, "<answer>3 * 7</answer>").reward == 1.0
    assert task.score(problem, "<answer>3 * 7 * 1</answer>").reward == 0.0


@pytest.mark.parametrize(
    "completion, reward, invalid",
    [
        ("6 * 12 = 72. The answer is 72.", 1.0, False),
        ("The answer is 72.\nQ: another\nA: The answer is 5.", 1.0, False),  # first answer only
        ("The answer is 7,2.", -1.0, False),
        ("seventy-two", -1.0, True),
    ],
)
def test_gsm8k_reward(completion, reward, invalid):
    task = get_task("gsm8k")
    problem = Problem(id="g", question="q", answer="72")
    result = task.score(problem, completion)
    assert (result.reward, result.invalid) == (reward, invalid)


def test_gsm8k_prompt_is_8_shot_and_gold_solutions_score_correct():
    task = get_task("gsm8k")
    problems = task.load()
    assert len(problems) == 12
    prompt = task.prompt(problems[0])
    assert prompt.count("Q: ") == 9 and prompt.endswith(f"Q: {problems[0].question}\nA:")
    assert problems[4].answer == "1070" and "<<" not in problems[4].solution
    for p in problems:
        assert task.score(p, task.gold_completion(p)).correct, p


def test_arithmetic_problems_are_seeded_and_answers_independent():
    task = get_task("arithmetic")
    a, b = task.load(num=40, seed=1), task.load(num=40, seed=1)
    assert a == b and a != task.load(num=40, seed=2)
    assert task.load(num=10, seed=1) == a[:10]  # nested: size does not change problem i
    for p in a:
        expr = p.question.removeprefix("What is ").removesuffix("?")
        assert parse_expression(expr).value == int(p.answer)  # second implementation
        assert task.score(p, p.solution).correct


def test_countdown_generated_gold_solutions_are_valid():
    task = get_task("countdown")
    for p in task.load(num=30, seed=0):
        assert task.score(p, p.solution).reward == 2.0, p


@pytest.mark.parametrize(
    "text, verdict",
    [("... The verdict is correct", True), ("The verdict is: **incorrect**.", False),
     ("The verdict is correct. Hmm, no: the verdict is incorrect", False), ("looks fine", None),
     ("The verdict is correctly stated", None)],
)
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) is verdict


ADVERSARIAL = [
    "The answer is " + "9" * 200_000,
    "The answer is " * 50_000,
    "\\boxed{" * 100_000,
    "{" * 200_000 + "\\boxed{1" + "}" * 10,
    "<answer>" * 100_000,
    "<answer>" + "(" * 100_000 + "</answer>",
    "<answer>" + "1+" * 100_000 + "1</answer>",
    "The verdict is " * 50_000,
]


def test_adversarial_long_inputs_finish_quickly():
    tasks = [get_task("gsm8k"), get_task("countdown"), get_task("verify", path="unused"), get_task("arithmetic")]
    problems = [Problem(id="g", question="q", answer="1"), COUNTDOWN, Problem(id="v", question="q", answer="correct"),
                Problem(id="a", question="q", answer="1")]
    start = time.monotonic()
    for text in ADVERSARIAL:
        last_boxed(text)
        for task, problem in zip(tasks, problems):
            result = task.score(problem, text)
            assert not result.correct
    # A functional bound, not a benchmark: quadratic scans of these 200 KB strings take minutes.
    assert time.monotonic() - start < 20
