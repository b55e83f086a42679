"""MATH rewards: math-verify in worker processes with a hard timeout, from any thread."""

from __future__ import annotations

import threading

import pytest

from jaxrl_llm.tasks import get_task
from jaxrl_llm.tasks.base import Problem


@pytest.fixture(scope="module")
def task():
    t = get_task("math", verifier_workers=2, verifier_timeout_s=20.0)
    yield t
    t.verifier.close()


def problem(gold: str) -> Problem:
    return Problem(id="m", question="q", answer=gold)


TABLE = [
    ("\\frac{1}{2}", "The final answer is \\boxed{\\frac12}.", True),
    ("\\frac{1}{2}", "so \\boxed{0.5}", True),
    ("5\\sqrt{2}", "\\boxed{\\sqrt{50}}", True),
    ("9\\pi", "\\boxed{9\\pi}", True),
    ("(-1, 5)", "\\boxed{(-1,5)}", True),
    ("1000", "\\boxed{1,000}", True),
    ("6", "first \\boxed{5} then \\boxed{6}", True),
    ("6", "\\boxed{5}", False),
    ("\\frac{7}{8}", "\\boxed{\\frac{8}{7}}", False),
]


def test_equivalence_table_in_one_parallel_batch(task):
    results = task.score_many([problem(g) for g, _, _ in TABLE], [c for _, c, _ in TABLE])
    assert [r.correct for r in results] == [want for _, _, want in TABLE]
    assert all(not r.invalid and r.info["verifier"] == "ok" for r in results)
    assert [r.reward for r in results] == [1.0 if want else -1.0 for _, _, want in TABLE]


def test_missing_box_is_invalid_not_a_verifier_call(task):
    before = task.metrics()["verifier/calls"]
    result = task.score(problem("2"), "The final answer is 2.")
    assert result.invalid and result.reward == -1.0 and result.answer is None
    assert task.metrics()["verifier/calls"] == before


def test_scoring_from_a_worker_thread_is_not_a_silent_zero(task):
    # math-verify's own signal timeout fails off the main thread; our process pool does not.
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=task.score(problem("\\frac{1}{2}"), "\\boxed{0.5}")))
    thread.start()
    thread.join()
    assert out["r"].correct and out["r"].info["verifier"] == "ok"


def test_runaway_verification_is_killed_and_counted():
    t = get_task("math", verifier_workers=1, verifier_timeout_s=1.0)
    try:
        tower = "2^{2^{2^{2^{2^{2^{2}}}}}}"  # sympy tries to evaluate a number with ~10^19728 digits
        slow, fine = t.score_many([problem("1"), problem("3")], [f"\\boxed{{{tower}}}", "\\boxed{3}"])
        assert slow.info["verifier"] == "timeout" and not slow.correct and not slow.invalid
        assert fine.correct  # the pool recovered with a fresh worker
        m = t.metrics()
        assert m["verifier/timeout"] == 1.0 and m["verifier/calls"] == 2.0
    finally:
        t.verifier.close()


def test_shipped_problems_gold_solutions_score_correct(task):
    problems = task.load()
    assert len(problems) == 8 and problems[0].answer == "\\frac{7}{8}"
    results = task.score_many(problems, [task.gold_completion(p) for p in problems])
    assert all(r.correct for r in results)
    assert task.prompt(problems[1]).endswith("Q:Solve for $x$: $3x - 7 = 11$. A:")
    assert "The final answer is \\boxed{X}" in task.prompt(problems[1])
