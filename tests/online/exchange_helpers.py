"""The storage pipeline's two sides as subprocesses (`jaxrl-llm online --role ...`, the
README's lines), in a temporary working directory with relative paths, and the serial run
they are compared with."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from tests.faults.harness import TIMEOUT_S, command
from tests.online.helpers import ROOT, final_arrays, metric_rows, saved_queue, tiny, write_yaml

TIMING = ("time", "seconds_sampling", "seconds_scoring", "seconds_training")
# staleness 2, 4 training rounds: 6 rounds, θ_0 … θ_3 sampled with
ONLINE = {"rounds": 4, "staleness": 2, "checkpoint_every": 1, "mu_source": "trainer"}


def readme_commands() -> list[list[str]]:
    """The two-process command lines of README § Sampling and training at the same time."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = re.findall(r"^(jaxrl-llm online --config online\.yaml --role [^\n]*?)( &)?$", text,
                       re.M)
    commands = [shlex.split(line)[1:] for line, _ in lines]
    assert [c[-1] for c in commands][:2] == ["trainer", "0"], commands
    return commands


def setup(directory: Path, **online: Any) -> None:
    """`online.yaml` (the storage pipeline, exchange `exchange/`, run `run/`) and
    `serial.yaml` (the same run, serial, into `serial/`) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    keep = {"keep_checkpoints": 100}
    write_yaml(directory / "online.yaml", tiny(Path("run"), train=keep, online={
        **ONLINE, "pipeline": "deterministic", "exchange": "exchange", "worker_timeout_s": 240,
        **online}))
    write_yaml(directory / "serial.yaml", tiny(Path("serial"), train=keep, online=ONLINE))


def start(args: list[str], cwd: Path, env: dict[str, str], log: str) -> subprocess.Popen:
    out = (cwd / log).open("w")
    return subprocess.Popen(command(args), cwd=cwd, env=env, stdout=out,
                            stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, cwd: Path, log: str) -> str:
    """Wait for `proc` (killed if it outlives the harness's timeout); its log; exit 0."""
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:  # a hung side: no process outlives the test
            proc.kill()
            proc.wait()
    text = (cwd / log).read_text(errors="replace")
    assert code == 0, f"{log}: exit {code}\n{text[-3000:]}"
    return text


def finish_all(procs: list[subprocess.Popen], cwd: Path, logs: list[str]) -> list[str]:
    """`finish` each; the others are killed when one fails."""
    try:
        return [finish(p, cwd, log) for p, log in zip(procs, logs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without timing and the pipeline's own columns (the serial loop has none)."""
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("pipeline/")}
            for r in rows]


def assert_serial_equal(cwd: Path) -> list[dict]:
    """`run/` (the storage pipeline) ends in `serial/`'s state bit for bit: params, optimizer
    state, step, RNG, every checkpoint's state and online meta, the metric rows; its rows."""
    step_a, serial = final_arrays(cwd / "serial")
    step_b, piped = final_arrays(cwd / "run")
    assert step_a == step_b == 6  # 4 training rounds + 2 that fill the queue
    assert serial.keys() == piped.keys() and any("opt_state" in k for k in serial)
    assert any("rng" in k for k in serial)
    assert not [k for k in serial if not np.array_equal(serial[k], piped[k])]
    _, first = final_arrays(cwd / "serial", step=2)  # before the first update
    assert any(not np.array_equal(first[k], serial[k]) for k in serial if "params" in k)
    for step in (3, 5):  # intermediate checkpoints too (queue, position, μ decision)
        _, a = final_arrays(cwd / "serial", step=step)
        _, b = final_arrays(cwd / "run", step=step)
        assert not [k for k in a if not np.array_equal(a[k], b[k])], step
        metas = [json.loads((cwd / d / f"checkpoints/{step}/meta/metadata").read_text())["online"]
                 for d in ("serial", "run")]
        # the storage trainer has no sampler: the workers' prompt batch (the serial loop's)
        # is in the exchange's sampler.json, not in the trainer's checkpoint
        workers = json.loads((cwd / "exchange/sampler.json").read_text())["sampler_batch"]
        assert metas[0].pop("sampler_batch") == workers and metas[1].pop("sampler_batch") is None
        assert metas[0] == metas[1]
        assert saved_queue(cwd / "serial", step) == saved_queue(cwd / "run", step)  # the records
    rows = metric_rows(cwd / "run")
    assert comparable(metric_rows(cwd / "serial")) == comparable(rows)
    return rows
