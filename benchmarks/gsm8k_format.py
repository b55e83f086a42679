"""How often the packaged SmolLM2-135M-Instruct answers the zero-shot GSM8K prompt in a form
the grader can read: `jaxrl-llm evaluate` on 32 easy one- and two-step word problems × 4
samples (T = 0.7, ≤ 256 tokens, the model's chat template, `num_shots: 0`,
`answer_format: "####"`, as README § Your own model and data configures it), run as a user
runs it in a temporary directory. The problems are written here from seeded templates (no
dataset is read). Prints the invalid rate and pass@1 and writes benchmarks/results/<out>.json.

    python benchmarks/gsm8k_format.py --out gsm8k_format_after
    PYTHONPATH=/path/to/older/checkout python benchmarks/gsm8k_format.py --out gsm8k_format_before

(`jaxrl-llm` resolves `jaxrl_llm` through PYTHONPATH, so the second line measures another
checkout's prompt with the same questions and seed.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CONFIG = """\
name: gsm8k_format
model: {source: smollm2}
data:
  task: gsm8k
  task_path: easy.jsonl
  task_options: {num_shots: 0, answer_format: "####"}
  chat_template: true
generate: {temperature: 0.7, max_new_tokens: 256, batch_size: 32}
eval: {n: 4, num_questions: 32, seed: 1234}
"""


def easy_problems(num: int, seed: int = 0) -> list[dict[str, str]]:
    """`num` GSM8K-format rows ({question, answer: "steps #### N"}) of one or two steps with
    small numbers, from templates and a seeded RNG."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 9)
        kind = i % 4
        if kind == 0:
            q = f"Ana has {a * b} apples and buys {c} more. How many apples does she have now?"
            steps, n = f"{a * b} + {c} = {a * b + c}", a * b + c
        elif kind == 1:
            q = f"A box holds {b} pencils. How many pencils are in {a} boxes?"
            steps, n = f"{a} * {b} = {a * b}", a * b
        elif kind == 2:
            q = (f"Tom buys {a} packs of {b} stickers and gives {c} stickers to a friend. "
                 "How many stickers does he have left?")
            steps, n = f"{a} * {b} = {a * b}. {a * b} - {c} = {a * b - c}", a * b - c
        else:
            q = f"{a * b} cookies are shared equally among {a} children. How many cookies does each child get?"
            steps, n = f"{a * b} / {a} = {b}", b
        rows.append({"question": q, "answer": f"{steps}.\n#### {n}"})
    return rows


def wording() -> str:
    """The zero-shot prompt (before the chat template) of the `jaxrl_llm` on PYTHONPATH."""
    from jaxrl_llm.tasks import get_task
    from jaxrl_llm.tasks.base import Problem

    task = get_task("gsm8k", num_shots=0, answer_format="####")
    return task.prompt(Problem(id="-", question="<question>", answer="0"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gsm8k_format")
    args = ap.parse_args(argv)
    exe = Path(sys.executable).with_name("jaxrl-llm")
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in easy_problems(32)))
        (cwd / "c.yaml").write_text(CONFIG)
        done = subprocess.run([str(exe), "evaluate", "--config", "c.yaml", "--out", "eval"],
                              cwd=cwd, capture_output=True, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if done.returncode:
            raise SystemExit(f"jaxrl-llm evaluate failed:\n{done.stderr[-3000:]}")
        result = json.loads((cwd / "eval" / "eval.json").read_text())
        samples = [json.loads(line) for line in
                   (cwd / "eval" / "samples.jsonl").read_text().splitlines()]
    answers = [a for s in samples for a in s["answers"]]
    out = {"wording": wording(), "config": CONFIG, "eval": result,
           # an instruction's example number read back often is copied, not computed
           "most_common_answers": Counter(answers).most_common(5), "answers": answers,
           "first_completions": [s["completions"][0] for s in samples[:3]]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"pass_at_1": result["pass_at_1"], "invalid": result["proportions"]["invalid"],
                      "most_common_answers": out["most_common_answers"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
