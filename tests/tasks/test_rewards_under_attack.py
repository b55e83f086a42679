"""Rewards under attack: fuzzed, hostile completions against every answer extractor and task.

Each call must return within `BOUND_S`, never execute its input, and score constructed
answers exactly as an independent evaluator (Fraction arithmetic, Decimal) says. The MATH path
runs math-verify in its worker pool under a hard timeout; a timeout or verifier failure is
flagged on the result/record (`reward_error`) and counted (`reward/timeouts`,
`reward/verifier_errors`), never a silent 0. Rows go to RELIABILITY.md (tests/reliability.py).
"""

from __future__ import annotations

import builtins
import os
import re
import subprocess
import time
from contextlib import contextmanager
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_llm.tasks import get_task
from jaxrl_llm.tasks.answers import answer_after_magic, last_boxed, normalize_number, numbers_equal
from jaxrl_llm.tasks.base import Problem
from jaxrl_llm.tasks.countdown import extract_answer_block
from jaxrl_llm.tasks.expression import ExpressionError, parse_expression
from jaxrl_llm.tasks.verify import parse_verdict
from tests.reliability import record

pytestmark = pytest.mark.reliability
BOUND_S = 1.0
SECTION = "rewards under attack"
MB = 1_000_000

FRAGMENTS = [
    "The answer is", "the ANSWER is ", "\\boxed{", "\\boxed ", "\\fbox{", "{", "}", "<answer>",
    "</answer>", "(", ")", "9**9**9", "1e999999", "9" * 5000, "1,000,000", "$", "−", "-", "١٢٣",
    "１２３", "²", "𝟗", "\u200b", "\u202e", "verdict is", "The verdict is **", " " * 1000, "*",
    "/0", "10^{10^{10^{10}}}", "\\frac{1}{", ",", ".", "\n", "__import__('os').system('id')",
    "a" * 300, "((((((((((", "1+" * 50,
]
# A fragment, optionally repeated until the text is up to 1 MB (regex-catastrophic runs).
PIECE = st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12))
HOSTILE = st.tuples(st.lists(PIECE, max_size=30).map("".join), st.integers(1, 100_000)).map(
    lambda t: t[0] * min(t[1], MB // max(1, len(t[0]))))


class Forbidden(AssertionError):
    pass


@contextmanager
def no_exec():
    """Any eval/exec/compile/os.system/subprocess during scoring is a failure, not a run."""
    def deny(*_a, **_k):
        raise Forbidden("scoring tried to execute code")

    saved = (builtins.eval, builtins.exec, builtins.compile, os.system, os.popen, subprocess.Popen)
    builtins.eval = builtins.exec = builtins.compile = os.system = os.popen = deny  # type: ignore[assignment]
    subprocess.Popen = deny  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        (builtins.eval, builtins.exec, builtins.compile, os.system, os.popen, subprocess.Popen) = saved


def timed(fn, *args):
    start = time.perf_counter()
    with no_exec():
        out = fn(*args)
    return out, time.perf_counter() - start


class Tally:
    def __init__(self) -> None:
        self.runs, self.failures = 0, []

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what[:200])

    def finish(self, scenario: str, detail: str) -> None:
        if self.runs == 0 and os.environ.get("PYTEST_XDIST_WORKER"):
            # pytest-xdist sent this module's scenario tests to the other worker: the row is
            # recorded by the reliability run (.ci/run: --dist loadfile runs them all here)
            pytest.skip("its scenario's tests ran in another pytest-xdist worker")
        record(SECTION, scenario, runs=self.runs, failures=len(self.failures), detail=detail)
        assert not self.failures, self.failures[:5]


TASKS = {name: get_task(name) for name in ("gsm8k", "arithmetic", "countdown")}
TASKS["verify"] = get_task("verify", path="unused")
PROBLEMS = {
    "gsm8k": Problem(id="g", question="q", answer="1"),
    "arithmetic": Problem(id="a", question="q", answer="1"),
    "countdown": TASKS["countdown"].make_problem(0),
    "verify": Problem(id="v", question="q", answer="correct"),
}
EXTRACTORS = [answer_after_magic, last_boxed, normalize_number, extract_answer_block, parse_verdict]
CANONICAL = re.compile(r"-?[0-9]+(\.[0-9]*[1-9])?")

FUZZ = Tally()


@settings(max_examples=150, suppress_health_check=list(HealthCheck))
@given(text=HOSTILE)
def test_fuzzed_extractors_and_task_rewards_are_bounded_and_safe(text):
    for fn in EXTRACTORS:
        FUZZ.runs += 1
        try:
            out, dt = timed(fn, text)
        except Forbidden:
            FUZZ.check(False, f"{fn.__name__} executed its input: {text[:60]!r}")
            continue
        FUZZ.check(dt <= BOUND_S, f"{fn.__name__} took {dt:.2f}s on {len(text)} chars {text[:40]!r}")
        if fn is answer_after_magic and out is not None:  # canonical ASCII number or nothing
            FUZZ.check(bool(CANONICAL.fullmatch(out)), f"answer_after_magic gave {out[:40]!r}")
    for name, task in TASKS.items():
        FUZZ.runs += 1
        try:
            result, dt = timed(task.score, PROBLEMS[name], text)
        except Forbidden:
            FUZZ.check(False, f"{name} executed its input")
            continue
        FUZZ.check(dt <= BOUND_S, f"{name}.score took {dt:.2f}s on {len(text)} chars")
        FUZZ.check(not (result.correct and result.invalid), f"{name}: correct and invalid")
        FUZZ.check(result.invalid == (result.answer is None), f"{name}: invalid without answer=None")


def test_zz_record_fuzz_row():
    # Runs after the fuzz test in this module (file order): one row for all its calls.
    FUZZ.finish("fuzzed extractors + task rewards (runs = calls)",
                "hypothesis texts up to 1 MB: nested/unclosed boxes, 9**9**9, 1e999999, fullwidth "
                f"and Arabic-Indic digits, RTL marks, whitespace runs; bound {BOUND_S}s, no eval/exec")


# -- constructed answers scored against an independent evaluator ---------------------------


def strip_all(text: str, needles: list[str]) -> str:
    """Remove every (case-insensitive) occurrence, repeatedly: removal can create new ones."""
    while True:
        new = text
        for n in needles:
            new = re.sub(re.escape(n), "", new, flags=re.IGNORECASE)
        if new == text:
            return text
        text = new


NOISE = st.lists(PIECE, max_size=15).map("".join)
GSM = Tally()


@settings(max_examples=120, suppress_health_check=list(HealthCheck))
@given(noise=NOISE, cents=st.integers(-10**15, 10**15), commas=st.booleans(), dollar=st.booleans(),
       fullwidth=st.booleans())
def test_gsm8k_scores_a_buried_answer_exactly(noise, cents, commas, dollar, fullwidth):
    value = Decimal(cents) / 100
    text = f"{abs(value):,}" if commas else f"{abs(value)}"
    if fullwidth:  # fullwidth digits are the same decimal digits (unicode category Nd)
        text = "".join(chr(0xFF10 + int(c)) if c.isdigit() else c for c in text)
    text = ("-" if value < 0 else "") + ("$" if dollar else "") + text
    completion = strip_all(noise, ["answer is", "\nQ:"]) + "\nThe answer is " + text + ".\nQ: more"
    gold = format(value.normalize(), "f")  # independent canonical form
    right = Problem(id="g", question="q", answer=gold)
    wrong = Problem(id="g", question="q", answer=format(value + Decimal("0.01"), "f"))
    task = TASKS["gsm8k"]
    GSM.runs += 1
    (good, dt1), (bad, dt2) = timed(task.score, right, completion), timed(task.score, wrong, completion)
    GSM.check(good.correct and not bad.correct and not good.invalid,
              f"{completion[-60:]!r}: gold {gold} -> {good.answer}")
    GSM.check(max(dt1, dt2) <= BOUND_S, f"took {max(dt1, dt2):.2f}s")


def test_zz_record_gsm8k_row():
    GSM.finish("GSM8K answer buried in hostile text", "noise + 'The answer is ±$1,234.56' "
               "(fullwidth digits too) scores correct vs its Decimal, wrong vs +0.01")


def expr_tree(depth: int):
    leaf = st.integers(1, 10**12)
    if depth == 0:
        return leaf
    sub = expr_tree(depth - 1)
    return st.one_of(leaf, st.tuples(st.sampled_from("+-*/"), sub, sub))


def value_of(tree) -> Fraction:
    """Independent evaluator (not the parser under test)."""
    if isinstance(tree, int):
        return Fraction(tree)
    op, a, b = tree
    x, y = value_of(a), value_of(b)
    return {"+": x + y, "-": x - y, "*": x * y, "/": x / y if y else None}[op]


def leaves(tree) -> list[int]:
    return [tree] if isinstance(tree, int) else leaves(tree[1]) + leaves(tree[2])


def render(tree, style: dict) -> str:
    if isinstance(tree, int):
        s = str(tree)
        return "".join(chr(0xFF10 + int(c)) for c in s) if style["fullwidth"] else s
    op, a, b = tree
    op = {"*": style["times"], "-": style["minus"]}.get(op, op)
    return f"({render(a, style)}{style['space']}{op}{style['space']}{render(b, style)})"


COUNTDOWN = Tally()


def _divides_by_zero(tree) -> bool:
    if isinstance(tree, int):
        return False
    return (_divides_by_zero(tree[1]) or _divides_by_zero(tree[2])
            or (tree[0] == "/" and value_of(tree[2]) == 0))


@settings(max_examples=150, suppress_health_check=list(HealthCheck))
@given(tree=expr_tree(3), noise=NOISE, style=st.fixed_dictionaries({
    "fullwidth": st.booleans(), "times": st.sampled_from(["*", "×", "x"]),
    "minus": st.sampled_from(["-", "−", "–"]), "space": st.sampled_from(["", " ", "\t"])}))
def test_countdown_parser_matches_an_independent_evaluator(tree, noise, style):
    equation = render(tree, style)
    numbers = leaves(tree)
    completion = strip_all(noise, ["<answer>", "</answer>"]) + f"<answer>{equation} = ?</answer>"
    COUNTDOWN.runs += 1
    try:
        parsed, dt = timed(parse_expression, equation)
    except ExpressionError as err:
        # Allowed only for a division by zero or an over-long equation.
        COUNTDOWN.check(_divides_by_zero(tree) or len(equation) > 256, f"{equation!r}: {err}")
        return
    value = value_of(tree)
    COUNTDOWN.check(parsed.value == value and list(parsed.numbers) == numbers, f"{equation!r}")
    if value.denominator == 1:
        problem = Problem(id="c", question="", answer=str(value),
                          metadata={"numbers": numbers, "target": int(value)})
        off = Problem(id="c", question="", answer="", metadata={"numbers": numbers, "target": int(value) + 1})
        (good, dt1), (bad, _) = timed(TASKS["countdown"].score, problem, completion), \
            timed(TASKS["countdown"].score, off, completion)
        COUNTDOWN.check(good.correct and good.reward == 2.0 and not bad.correct and bad.reward == 0.0,
                        f"{completion[-80:]!r}: {good.info} / {bad.info}")
        dt = max(dt, dt1)
    COUNTDOWN.check(dt <= BOUND_S, f"took {dt:.2f}s")


def test_zz_record_countdown_row():
    COUNTDOWN.finish("Countdown parser vs an independent Fraction evaluator",
                     "random trees of 12-digit numbers, ×/x/−/– aliases, fullwidth digits, "
                     "hostile noise before <answer>; value, numbers used and reward exact")


BOXED = Tally()
BALANCED = st.recursive(st.text(alphabet="0123456789+-x\\frac^_ ,.", max_size=8),
                        lambda inner: st.lists(inner, max_size=3).map(lambda xs: "{" + "".join(xs) + "}"),
                        max_leaves=20)


@settings(max_examples=150, suppress_health_check=list(HealthCheck))
@given(prefix=NOISE, content=BALANCED, suffix=NOISE)
def test_last_boxed_finds_a_buried_box(prefix, content, suffix):
    # Any prefix (unbalanced braces included); a suffix without another box.
    text = prefix + "\\boxed{" + content + "}" + strip_all(suffix, ["\\boxed", "\\fbox"])
    BOXED.runs += 1
    out, dt = timed(last_boxed, text)
    BOXED.check(out == content, f"{text[-80:]!r} -> {out!r}")
    BOXED.check(dt <= BOUND_S, f"took {dt:.2f}s")


def test_zz_record_boxed_row():
    BOXED.finish("MATH last \\boxed{} buried in hostile text",
                 "hostile prefix (unclosed braces/boxes) + \\boxed{balanced} + box-free suffix -> the content")


def test_huge_numbers_and_exponents_never_blow_up():
    # int('9' * 5000) and str(int(Decimal('1e999999'))) would hit Python's digit limits.
    cases = ["The answer is 1e999999", "The answer is " + "9" * 100_000, "The answer is 9**9**9",
             "The answer is 1" + ",000" * 100_000, "The answer is " + "1" * 64 + ".5"]
    runs = 0
    for text in cases:
        for task in (TASKS["gsm8k"], TASKS["arithmetic"]):
            result, dt = timed(task.score, PROBLEMS["gsm8k"], text)
            runs += 1
            assert dt <= BOUND_S
    assert answer_after_magic("The answer is " + "9" * 100_000) is None  # > 64 digits: not a number
    assert answer_after_magic("The answer is 9**9**9") == "9"  # the first number; never evaluated
    assert not numbers_equal("1e999999", "1") and normalize_number("1e999999") == Decimal("1e999999")
    assert parse_verdict("The verdict is" + " " * 200_000 + "x") is None
    record(SECTION, "huge numbers and exponents (GSM8K, arithmetic)", runs=runs, failures=0,
           detail="1e999999, 100k-digit numbers, 9**9**9, 100k thousands groups: bounded, never evaluated")


def test_unicode_digit_lookalikes_are_errors_not_crashes():
    # '²' is str.isdigit() but int() rejects it: it must be a parse error, not a ValueError.
    task, problem = TASKS["countdown"], PROBLEMS["countdown"]
    looks = ["²", "𝟗", "٣", "①", "Ⅻ", "\u0661\u0662", "1\u200b2", "৪"]
    for s in looks:
        result, dt = timed(task.score, problem, f"<answer>{s} + 1</answer>")
        assert dt <= BOUND_S and not result.correct and not result.invalid
    assert parse_expression("１２ + ٣").value == 15  # decimal digits of any script are digits
    with pytest.raises(ExpressionError, match="unexpected character '²'"):
        parse_expression("²+1")
    record(SECTION, "unicode digit look-alikes in Countdown", runs=len(looks), failures=0,
           detail="superscript/circled/roman/math-bold digits -> 'parse error: unexpected character', "
                  "fullwidth/Arabic-Indic decimal digits read as digits")


# -- the MATH path: math-verify in its process pool -----------------------------------------

PAYLOAD = "__import__('os').system('touch {s}')"


@pytest.fixture(scope="module")
def math_task():
    task = get_task("math", verifier_workers=2, verifier_timeout_s=BOUND_S)
    task.verifier.wait_ready()
    yield task
    task.verifier.close()


def hostile_math_answers(sentinel: str) -> list[str]:
    payload = PAYLOAD.format(s=sentinel)
    return [payload, f"\\text{{{payload}}}", f"exec(\"open('{sentinel}','w')\")",
            "9**9**9", "1e999999", "10^{10^{10^{10}}}", "2^{2^{2^{2^{2^{2^{2}}}}}}",
            "(" * 30 + "1" + ")" * 30, "\\frac" * 500, "１２", "9" * 1500, "x" * (MB // 10)]


def test_math_path_hostile_answers_bounded_flagged_and_counted(math_task, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    answers = hostile_math_answers(str(sentinel))
    problems = [Problem(id=f"m{i}", question="q", answer="12") for i in range(len(answers))]
    failures, statuses = [], []
    before = math_task.metrics()
    for problem, answer in zip(problems, answers):
        math_task.verifier.wait_ready()  # a worker restart after a timeout is not this call's time
        start = time.perf_counter()
        (result,) = math_task.score_many([problem], [f"so \\boxed{{{answer}}}"])
        dt = time.perf_counter() - start
        status = result.info["verifier"]
        statuses.append(status)
        flag = {"ok": None, "timeout": "timeout", "error": "verifier_error"}[status]
        if dt > BOUND_S + 0.5 or result.info.get("reward_error") != flag or result.invalid:
            failures.append(f"{answer[:30]!r}: {dt:.2f}s {result.info}")
        if answer == "１２" and not result.correct:  # fullwidth 12 is 12
            failures.append("fullwidth 12 not equal to 12")
    after = math_task.metrics()
    assert not sentinel.exists(), "a verifier executed its input"
    assert after["reward/timeouts"] - before["reward/timeouts"] == statuses.count("timeout")
    assert after["reward/verifier_errors"] - before["reward/verifier_errors"] == statuses.count("error")
    assert statuses.count("timeout") >= 1  # the towers must actually exercise the hard timeout
    record(SECTION, "MATH path: hostile boxed answers through math-verify", runs=len(answers),
           failures=len(failures), detail=f"os.system/exec payloads (sentinel never created), 9**9**9, "
           # no counts here: which towers time out depends on the machine's speed
           f"power towers, 1e999999, 100 kB: every timeout and verifier error flagged as "
           f"reward_error and counted; bound {BOUND_S}s + 0.5s")
    assert not failures, failures


class _Tok:
    """Decodes token i to the i-th scripted completion text."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def decode(self, ids, skip_special_tokens=True):
        return self.texts[ids[0]]


def test_timeout_is_flagged_on_the_record_and_in_generate_and_eval_metrics(math_task, tmp_path, monkeypatch):
    from jaxrl_llm.data.shards import RecordSource, ShardWriter
    from jaxrl_llm.eval import evaluate
    from jaxrl_llm.generate.completions import Completion, build_records

    texts = ["\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}", "\\boxed{12}", "\\boxed{" + "x" * 3000 + "}", "no box"]
    problems = [Problem(id="m", question="q", answer="12")]
    comps = [Completion(0, np.array([i], np.int32), np.array([-0.5], np.float32)) for i in range(len(texts))]
    math_task.verifier.wait_ready()
    before = math_task.metrics()
    records = build_records(math_task, problems, [[1, 2]], comps, _Tok(texts))
    flags = [r.metadata.get("reward_error") for r in records]
    assert flags == ["timeout", None, "verifier_error", None]
    assert [r.correct for r in records] == [False, True, False, False] and records[3].invalid
    with ShardWriter(tmp_path / "recs", task="math") as w:
        w.write_all(records)
    assert [r.metadata.get("reward_error") for r in RecordSource(tmp_path / "recs")] == flags
    got = math_task.metrics()
    assert got["reward/timeouts"] - before["reward/timeouts"] == 1
    assert got["reward/verifier_errors"] - before["reward/verifier_errors"] == 1

    # evaluate: the same completions through evaluate_model's grading, sampler stubbed out.

    # (patched where evaluate reads them: it imports both at module level)
    monkeypatch.setattr(evaluate, "sample_completions", lambda *a, **k: comps)
    monkeypatch.setattr(evaluate, "build_sampler",
                        lambda *a, **k: SimpleNamespace(batch_size=len(problems)))
    tok = _Tok(texts)
    tok.encode = lambda text, add_special_tokens=True: [1, 2]  # type: ignore[attr-defined]
    summary, _ = evaluate.evaluate_model(None, tok, math_task, problems, n=4, temperature=1.0,
                                         max_new_tokens=4, maj_k=(1,), trials=2)
    assert summary["reward/timeouts"] == 1.0 and summary["reward/verifier_errors"] == 1.0
    record(SECTION, "timeout/verifier error flagged on record and counted", runs=1, failures=0,
           detail="power tower -> record.metadata reward_error='timeout' (kept through shards), "
                  "3000-char answer -> 'verifier_error'; manifest task_metrics and eval.json "
                  "reward/timeouts=1, reward/verifier_errors=1")


@pytest.mark.slow
def test_fuzzed_math_verifier_bounded(math_task, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    payload = PAYLOAD.format(s=sentinel)
    tally = Tally()

    @settings(max_examples=40, suppress_health_check=list(HealthCheck))
    @given(answer=st.lists(st.sampled_from(["2^{", "}", "9**9**9", "\\frac{1}{", "1e999999", "(", ")",
                                            "\\sqrt{", "x", "+", "１", payload, "\\infty", "^"]),
                           max_size=20).map("".join))
    def run(answer):
        math_task.verifier.wait_ready()
        start = time.perf_counter()
        outcome = math_task.verifier.verify("12", answer)
        dt = time.perf_counter() - start
        tally.runs += 1
        tally.check(dt <= BOUND_S + 0.5, f"{answer!r} took {dt:.2f}s")
        tally.check(outcome.status in ("ok", "timeout", "error"), f"{answer!r}: {outcome}")

    run()
    assert not sentinel.exists()
    tally.finish("MATH verifier fuzzed (hypothesis)", f"random towers/fractions/payloads; "
                 f"bound {BOUND_S}s + 0.5s per call in the process pool, sentinel never created")
