"""experiments/invalid_answers.py splits invalid answers by how they end; checked on hand-made
evaluation rows whose causes and rates are counted here by hand."""

from __future__ import annotations

import pytest

from experiments.invalid_answers import breakdown, cause
from jaxrl_llm.tasks.answers import answer_after_magic


def words(text: str) -> int:  # a stand-in tokenizer: one token per word
    return len(text.split())


def test_causes_follow_the_answer_the_length_and_the_magic_string():
    cap = 6
    assert cause("3", "1 + 2 = 3 The answer is 3.", 7, cap) == "valid"
    assert cause(None, "1 + 2 = 3 1 + 2 =", 6, cap) == "cut"
    assert cause(None, "1 + 2 = 33 4", 5, cap) == "cut"  # one merge short of the cap
    assert cause(None, "1 + 2 = 3", 4, cap) == "no_magic"
    assert cause(None, "The answer is .", 4, cap) == "no_number"


def test_breakdown_of_hand_made_rows():
    texts = ["1 + 2 = 3\nThe answer is 3.",        # correct, 9 words
             "1 + 2 = 4\nThe answer is 4.",        # incorrect, 9 words
             "1 + 2 = 3 4 5 6 7 8 9 10",           # cut at the cap (12 words)
             "answer is 3."]                       # no magic string (3 words)
    one_op = {"question": "What is 1 + 2?", "completions": texts,
              "answers": [answer_after_magic(t) for t in texts],
              "correct": [True, False, False, False]}
    two_ops = {"question": "What is (1 + 2) * 3?",
               # no number after the magic string (8 words); correct (9 words)
               "completions": ["(1 + 2) = 3\nThe answer is", "3 * 3 = 9\nThe answer is 9."],
               "answers": [None, "9"], "correct": [False, True]}
    assert one_op["answers"] == ["3", "4", None, None]
    out = breakdown([one_op, two_ops], words, max_new_tokens=12)
    assert out["completions"] == 6
    assert out["invalid"] == pytest.approx(3 / 6)
    assert out["invalid_by_cause"] == pytest.approx({"cut": 1 / 6, "no_magic": 1 / 6,
                                                     "no_number": 1 / 6})
    assert out["invalid_by_ops"] == pytest.approx({"1": 2 / 4, "2": 1 / 2})
    assert out["mean_tokens"] == pytest.approx({"correct": (9 + 9) / 2, "incorrect": 9.0,
                                                "invalid": (12 + 3 + 8) / 3})
    assert len(out["examples"]) == 3 and "What is 1 + 2?" in out["examples"][0]
