"""Issue 33, progress: every stage that can take more than a few seconds says how far it is —
a tqdm bar on a terminal, whole lines in a log (one per update here: JAXRL_PROGRESS_INTERVAL_S=0;
by default at most one every 10 s). `generate` and `evaluate` move as prompts get all their
samples (the bar used to count chunks of four batches and sat at 0 %), and in between their
line shows the decode step of the longest sample running; `train.eval_every`'s evaluations
show the same count of their own."""

from __future__ import annotations

import os
import pty
import re
import subprocess
from pathlib import Path

import pytest

from tests.faults.harness import command
from tests.user.cli import jaxrl, user_env

CONFIG = ("run_dir: run\nmesh: {data: 1}\nloss: {name: topr}\n"
          # a random model's records hold no positive: train anyway (data/signal.py)
          "train: {steps: 2, batch_size: 8, max_seq_len: 160, checkpoint_every: 2, "
          "allow_no_signal: true, eval_every: 2}\n"
          "generate: {n: 2, max_new_tokens: 8, batch_size: 4, output: recs}\n"
          "data: {num_prompts: 12, records: recs}\neval: {n: 2, num_questions: 8, batch_size: 4}\n")


def _lines(text: str, stage: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(rf"^{stage}[^:\n]*: (\d+)/(\d+) ", text, re.M)]


def _counts(text: str, stage: str) -> list[tuple[int, int]]:
    """The counts a stage's lines went through (a line within a batch, which shows the decode
    step, repeats the count of the batches done)."""
    seen: list[tuple[int, int]] = []
    for count in _lines(text, stage):
        if not seen or seen[-1] != count:
            seen.append(count)
    return seen


@pytest.mark.slow
def test_every_stage_prints_progress_lines_in_a_log(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG)
    env = {"JAXRL_PROGRESS_INTERVAL_S": "0"}
    runs = {stage: jaxrl(tmp_path, *args, **env) for stage, args in (
        ("generate", ("generate", "--config", "c.yaml")),
        ("score", ("score", "--config", "c.yaml")),
        ("train", ("train", "--config", "c.yaml")),
        ("export", ("export", "--checkpoint", "run", "--out", "hf")),
        ("evaluate", ("evaluate", "--config", "c.yaml", "--model", "hf")))}
    for stage, done in runs.items():
        assert done.returncode == 0, (stage, done.stderr[-2000:])
        assert "\r" not in done.stderr, stage  # no carriage-return redraws in a log
    # The continuous sampler counts prompts as their samples end (not whole prompt batches).
    for stage, total in (("generate", 12), ("evaluate", 8)):
        seen = _counts(runs[stage].stderr, stage)
        assert seen[0] == (0, total) and seen[-1] == (total, total), seen
        assert all(a[0] < b[0] for a, b in zip(seen, seen[1:])) and len(seen) > 2, seen
    # and within a batch the line shows the decode step (issue 41: progress inside a batch)
    for stage in ("generate", "evaluate"):
        assert re.search(rf"^{stage}[^\n]*batch 1/\d+: token \d+/8", runs[stage].stderr, re.M), \
            runs[stage].stderr[-2000:]
    assert _lines(runs["score"].stderr, "score")[-1] == (24, 24)
    assert _lines(runs["train"].stderr, "train")[-1] == (2, 2)
    # train.eval_every: each evaluation (before, at step 2) counts its own questions, as
    # `evaluate` does (issue 55 item 15: the line sat at "evaluating step 0")
    for at in (0, 2):
        seen = _counts(runs["train"].stderr, f"evaluate arithmetic at step {at}")
        assert seen[0] == (0, 8) and seen[-1] == (8, 8), (at, seen)
    exported = _lines(runs["export"].stderr, "export")
    assert exported[-1][0] == exported[-1][1] > 10  # every tensor of the model


@pytest.mark.slow
def test_a_terminal_gets_a_tqdm_bar(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG)
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(command(["generate", "--config", "c.yaml"]), cwd=tmp_path,
                              env=user_env(), stdout=subprocess.PIPE, stderr=follower, timeout=600)
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(leader)
    err = b"".join(chunks).decode(errors="replace")
    assert done.returncode == 0, err[-2000:]
    assert "\r" in err and "12/12" in err and "prompt/s" in err, err[-1000:]
