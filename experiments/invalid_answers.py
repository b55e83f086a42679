"""Where the invalid answers of a `jaxrl-llm quickstart` / `iterate` run come from.

An answer is invalid when no number follows a last "The answer is" (tasks/answers.py,
TOPR arXiv:2503.14286 Fig. 3's measure). For each evaluated policy of a run
(`RUN_DIR/iter_i/eval/samples.jsonl`, π_0 in iter_0) this splits the invalid completions by
how they end:

- **cut**: the completion reached `max_new_tokens` (no end-of-sequence token before the cap:
  its text re-encoded by the run's tokenizer is at least `max_new_tokens − 1` tokens long, as a
  decode/encode round trip may merge one pair);
- **no_magic**: it ended (EOS) before the cap without "The answer is";
- **no_number**: it ended with "The answer is" and no number after it;

and gives the invalid rate per number of operations in the question, the mean length in tokens
of the correct, incorrect and invalid completions, and a few invalid completions verbatim.

    python experiments/invalid_answers.py RUN_DIR [RUN_DIR ...] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = "the answer is"
OPERATORS = re.compile(r" [-+*] ")  # the arithmetic task renders a binary op with spaces around


def cause(answer: str | None, text: str, tokens: int, max_new_tokens: int) -> str:
    """'valid' (an answer was extracted), else 'cut', 'no_magic' or 'no_number' (module
    docstring)."""
    if answer is not None:
        return "valid"
    if tokens >= max_new_tokens - 1:
        return "cut"
    return "no_number" if MAGIC in text.lower() else "no_magic"


def breakdown(rows: Sequence[dict[str, Any]], count_tokens: Callable[[str], int],
              max_new_tokens: int, examples: int = 5) -> dict[str, Any]:
    """The split of one evaluation's `samples.jsonl` rows (module docstring)."""
    causes = {"cut": 0, "no_magic": 0, "no_number": 0}
    lengths: dict[str, list[int]] = {"correct": [], "incorrect": [], "invalid": []}
    by_ops: dict[int, list[int]] = {}  # ops → [invalid, total]
    shown: list[str] = []
    total = 0
    for row in rows:
        ops = len(OPERATORS.findall(row["question"]))
        for answer, correct, text in zip(row["answers"], row["correct"], row["completions"],
                                         strict=True):
            tokens = count_tokens(text)
            kind = cause(answer, text, tokens, max_new_tokens)
            total += 1
            counts = by_ops.setdefault(ops, [0, 0])
            counts[1] += 1
            if kind == "valid":
                lengths["correct" if correct else "incorrect"].append(tokens)
                continue
            causes[kind] += 1
            counts[0] += 1
            lengths["invalid"].append(tokens)
            if len(shown) < examples:
                shown.append(f"{row['question']} -> {text!r}")
    invalid = sum(causes.values())
    return {"completions": total, "invalid": invalid / total if total else 0.0,
            "invalid_by_cause": {k: v / total for k, v in causes.items()},
            "invalid_by_ops": {str(k): v[0] / v[1] for k, v in sorted(by_ops.items())},
            "mean_tokens": {k: float(np.mean(v)) if v else None for k, v in lengths.items()},
            "examples": shown}


def run_breakdown(run_dir: Path, max_new_tokens: int | None = None) -> dict[str, Any]:
    """`breakdown` of every evaluated policy of a run, by iteration (0 = π_0)."""
    from transformers import AutoTokenizer

    config = json.loads((run_dir / "config.json").read_text())
    cap = max_new_tokens or config["eval"].get("max_new_tokens") or \
        config["generate"]["max_new_tokens"]
    tokenizer_dir = run_dir / "tokenizer" if (run_dir / "tokenizer").is_dir() else \
        Path(config["data"]["tokenizer"] or config["model"]["path"])
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    out = {}
    for samples in sorted(run_dir.glob("iter_*/eval/samples.jsonl"),
                          key=lambda p: int(p.parts[-3].split("_")[1])):
        rows = [json.loads(line) for line in samples.read_text().splitlines() if line]
        out[samples.parts[-3]] = breakdown(rows, count, cap)
    return {"max_new_tokens": cap, "iterations": out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="the evaluation's cap (default: the run's config.json)")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        result = run_breakdown(run_dir, args.max_new_tokens)
        print(f"{run_dir} (max_new_tokens {result['max_new_tokens']})")
        for name, b in result["iterations"].items():
            causes = ", ".join(f"{k} {v:.3f}" for k, v in b["invalid_by_cause"].items())
            ops = ", ".join(f"{k} ops {v:.3f}" for k, v in b["invalid_by_ops"].items())
            tokens = ", ".join(f"{k} {v:.1f}" for k, v in b["mean_tokens"].items()
                               if v is not None)
            print(f"  {name}: invalid {b['invalid']:.3f} ({causes}); by question: {ops}; "
                  f"mean tokens: {tokens}")
            for example in b["examples"]:
                print(f"      {example}")


if __name__ == "__main__":
    main()
