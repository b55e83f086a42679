"""The calculator: exact arithmetic from a whitelist of syntax (checked against an independent
evaluator of random trees), hostile input refused quickly, and a whole calculator episode."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest

from jaxrl_llm.envs.calculator import CalculatorEnv, CalculatorError, evaluate, format_value
from jaxrl_llm.envs.episodes import EpisodeRunner
from jaxrl_llm.envs.render import TurnRenderer
from jaxrl_llm.tasks.arithmetic import ArithmeticTask
from tests.envs.helpers import qwen_tokenizer
from tests.reliability import record

SECTION = "rewards under attack"


def _tree(rng: random.Random, depth: int) -> tuple[str, Fraction]:
    """A random expression's text and its value, computed here on Fractions directly."""
    if depth == 0 or rng.random() < 0.3:
        n = rng.randint(0, 10**6)
        return str(n), Fraction(n)
    op = rng.choice("+-*/")
    (a, va), (b, vb) = _tree(rng, depth - 1), _tree(rng, depth - 1)
    if op == "/" and vb == 0:
        op = "+"
    value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va / vb if vb else 0}[op]
    return f"({a} {op} {b})", value


def test_exact_value_against_an_independent_evaluator():
    rng = random.Random(0)
    for _ in range(300):
        text, value = _tree(rng, 4)
        assert evaluate(text) == value, text
    assert evaluate("-(3) ** 2 + 7 // 2 + 7 % 4 + 2^3") == Fraction(-9 + 3 + 3 + 8)
    assert evaluate("1.5 * 4") == 6 and evaluate("12 × 7 ÷ 4 − 1") == 20
    assert format_value(Fraction(1, 3)) == "0.333333333333"
    assert format_value(Fraction(5, 2)) == "2.5" and format_value(Fraction(-84)) == "-84"


HOSTILE = [
    "__import__('os').system('touch {sentinel}')",
    "open('{sentinel}', 'w')",
    "().__class__.__bases__[0].__subclasses__()",
    "9**9**9", "10**100000", "2**5000", "(10**600)**8", "2**-9999", "0**-1",
    "1/0", "5 % 0", "7 // 0", "1e999", "-1e999 * 0", "float('inf')", "1j", "True + 1",
    "'abc'", "b'x'", "[1] * 10**9", "lambda: 1", "a", "1 if 1 else 2", "(1 +)", "",
    "1" * 1_000_000, "(" * 5_000 + "1" + ")" * 5_000, "-" * 150 + "1", "+".join("1" * 100),
]


@pytest.mark.reliability
def test_hostile_expressions(tmp_path: Path):
    sentinel = tmp_path / "pwned"
    failures = []
    for text in HOSTILE:
        text = text.replace("{sentinel}", str(sentinel))
        try:
            value = evaluate(text)
            failures.append(f"{text[:40]!r} evaluated to {value}")
        except CalculatorError as err:
            assert str(err)  # a message the model can read
    # Deep but short parentheses (no AST node) and a big but bounded power still work.
    assert evaluate("(" * 60 + "1" + ")" * 60) == 1 and evaluate("3**1000") == 3**1000
    assert not sentinel.exists()
    record(SECTION, "calculator tool: hostile expressions", runs=len(HOSTILE),
           failures=len(failures),
           detail="__import__/open/dunder payloads (sentinel never created), 9**9**9, 10**100000, "
           "1e999, division by zero, strings, lambdas, names, 1 MB of digits, 5,000 nested "
           "parentheses, 100 chained operations: each a CalculatorError before any big value is built; ast.parse and a "
           "node whitelist, never eval")
    assert not failures, failures


def test_a_calculator_episode_scored_by_the_task():
    task = ArithmeticTask()
    env = CalculatorEnv(task=task)
    renderer = TurnRenderer(qwen_tokenizer(), chat_template=True, tools=env.tools())
    runner = EpisodeRunner(env, renderer, max_turns=4, max_episode_tokens=1024, timeout_s=30,
                           workers=2)
    tok = renderer.tokenizer
    prob = task.load(num=3)[2]
    expression = prob.question.removeprefix("What is ").removesuffix("?")

    def turn(episode, text):
        ids = list(tok.encode(text, add_special_tokens=False)) + [renderer.end_of_turn_id]
        return runner.submit(episode, ids, [-0.1] * len(ids), True).result(timeout=60)

    episode = runner.begin(prob)
    assert "calculator" in tok.decode(episode.prompt_ids)  # the tool is listed for the model
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    obs = turn(episode, f"<tool_call>\n{call}\n</tool_call>")
    assert f"<tool_response>\n{prob.answer}\n</tool_response>" in tok.decode(obs)
    obs = turn(episode, '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>'
               '<tool_call>{"name": "calculator", "arguments": {"expression": "9**9**9"}}'
               "</tool_call><tool_call>{oops}</tool_call>")
    text = tok.decode(obs)
    assert "Error: tool call 3: malformed JSON" in text
    assert "Error: unknown tool 'abacus'" in text
    assert "Error: calculator: exponent 387420489 is larger than 1000" in text
    assert turn(episode, f"The answer is {prob.answer}.") is None
    rec = runner.finish(episode)
    assert rec.reward == 1.0 and rec.correct  # the task's own reward for its own answer
    meta = rec.metadata["episode"]
    assert (meta["num_turns"], meta["tool_calls"], meta["tool_errors"]) == (3, 4, 3)
    assert meta["truncated"] is None

    wrong = runner.begin(prob)
    turn(wrong, f"<tool_call>\n{call}\n</tool_call>")
    turn(wrong, f"<tool_call>\n{call}\n</tool_call>")
    turn(wrong, f"<tool_call>\n{call}\n</tool_call>")
    assert turn(wrong, f"<tool_call>\n{call}\n</tool_call>") is None
    rec = runner.finish(wrong)
    assert rec.metadata["episode"]["truncated"] == "max_turns"
    assert rec.reward == -1.0 and rec.invalid  # cut off mid tool use: no answer, the task's -1
