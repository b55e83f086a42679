"""Issue 33, tasks: GSM8K zero-shot with its own `#### N` answer format and a system prompt,
on one's own JSONL, through the packaged SmolLM2 tokenizer; the chat template is used by
default when the tokenizer has one, and the command says so."""

from __future__ import annotations

import json
from pathlib import Path

from tests.user.cli import jaxrl

ROWS = [{"question": "Ana buys 3 packs of 8 markers and gives away 5. How many are left?",
         "answer": "3 * 8 = <<3*8=24>>24.\n24 - 5 = <<24-5=19>>19.\n#### 19"},
        {"question": "A farmer has 1,200 eggs and sells half. How many are left?",
         "answer": "1200 / 2 = <<1200/2=600>>600.\n#### 600"}]
SYSTEM = "You are a careful math tutor."
CONFIG = f"""model: {{source: smollm2}}
data:
  task: gsm8k
  task_path: my_gsm8k.jsonl
  task_options: {{num_shots: 0, answer_format: "####"}}
  system_prompt: {SYSTEM}
"""


def test_zero_shot_gsm8k_with_hash_answers_and_a_system_prompt(tmp_path: Path) -> None:
    from jaxrl_llm.data.shards import RecordSource

    (tmp_path / "my_gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "c.yaml").write_text(CONFIG)
    done = jaxrl(tmp_path, "generate", "--config", "c.yaml", "--gold", "--out", "gold")
    assert done.returncode == 0, done.stderr
    assert "data.chat_template is unset: the tokenizer has a chat template" in done.stderr
    records = list(RecordSource(tmp_path / "gold"))
    assert len(records) == 2
    for record, row in zip(records, ROWS, strict=True):
        # SmolLM2's ChatML, written out by hand: our system turn replaces its default one.
        assert record.prompt_text == (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
            "Solve the problem step by step. End with the final answer on its own line, as in "
            "this example.\n\nQ: Tom has 2 apples and buys 3 more. How many apples does he "
            "have?\nA: Tom has 2 + 3 = 5 apples.\n#### 5\n\n"
            f"Q: {row['question']}\nA:<|im_end|>\n<|im_start|>assistant\n")
        gold = row["answer"].rsplit("#### ", 1)[1]
        assert record.completion_text.rstrip().endswith(f"#### {gold}"), record.completion_text
        assert record.correct and record.reward == 1.0  # the grader reads the #### line
        # the 8-shot prompt alone is ~640 tokens; the zero-shot one holds one short example
        assert record.prompt_ids.size < 160


def test_gsm8k_hash_format_grades_only_hash_answers() -> None:
    from jaxrl_llm.tasks import get_task
    from jaxrl_llm.tasks.base import Problem

    task = get_task("gsm8k", answer_format="####")
    problem = Problem(id="p", question="q", answer="1200")
    assert task.score(problem, "so 1,200 eggs.\n#### 1,200").correct
    assert task.score(problem, "The answer is 1200.").invalid  # the other format is not read
    assert not get_task("gsm8k").score(problem, "#### 1200").correct


def test_an_unknown_task_option_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG.replace('"####"', '"###"'))
    (tmp_path / "my_gsm8k.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    done = jaxrl(tmp_path, "generate", "--config", "c.yaml", "--gold", "--out", "gold")
    assert done.returncode == 2
    assert "data.task_options" in done.stderr and "answer_format" in done.stderr


def test_zero_shot_prompt_has_a_worked_example_the_grader_reads() -> None:
    """Issue 42: asked for "#### N", SmolLM2-135M wrote the letter N. The zero-shot prompt now
    holds one worked example whose last line is a numbered answer in the task's format; that
    line, read by the grader, gives the example's answer, worked out here by hand: Tom has
    2 apples and buys 3 more, 2 + 3 = 5."""
    from jaxrl_llm.tasks import get_task
    from jaxrl_llm.tasks.base import Problem

    for fmt, line in (("####", "#### 5"), ("The answer is", "The answer is 5.")):
        task = get_task("gsm8k", num_shots=0, answer_format=fmt)
        prompt = task.prompt(Problem(id="p", question="How many pens?", answer="9"))
        example, question = prompt.split("\n\nQ: ")[1:]
        assert example.startswith("Tom has 2 apples and buys 3 more.") and question == (
            "How many pens?\nA:"), prompt
        assert example.endswith(f"\n{line}"), example  # the answer line closes the example
        assert "N'" not in prompt  # no placeholder letter to copy
        graded = task.score(Problem(id="e", question="", answer="5"), example)
        assert (graded.answer, graded.correct, graded.invalid) == ("5", True, False)
