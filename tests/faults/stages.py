"""The fault-injection scenarios: one `Stage` per point of the flow, and `run_case`, one
signal + resume + checks in a fresh working directory.

Every command is the user's (`jaxrl-llm train|generate|score|curate|export|iterate`) with
relative paths in its working directory; the generate/score/curate stages use the shipped
`configs/generate_cpu_arithmetic.yaml` with a smaller output.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records
from tests.faults import checks
from tests.faults.harness import Kill, Trigger, after, cli, expected_exit, interrupt, random_delay

REPO = Path(__file__).resolve().parents[2]
GEN_CONFIG = str(REPO / "configs" / "generate_cpu_arithmetic.yaml")
GEN_OVERRIDES = ["generate.max_new_tokens=8", "generate.records_per_shard=8"]
RECORDS, SCORED, CURATED = (Path("runs/data/cpu_arithmetic"), Path("runs/data/cpu_arithmetic-scored"),
                            Path("runs/data/cpu_arithmetic-curated"))
GEN_STAGES = ("generate", "score", "curate", "train", "export")


def train_records(directory: Path, num: int) -> None:
    """`num` records with distinct tokens (a record's tokens identify it) and μ log-probs."""
    rng = np.random.default_rng(num)
    out = []
    for i in range(num):
        completion = rng.integers(1, 64, size=int(rng.integers(3, 9)))
        out.append(Record(
            prompt_ids=np.array([1, 2 + i, 3]), completion_ids=completion,
            reward=1.0 if i % 3 == 0 else -1.0, correct=i % 3 == 0, group_id=i // 4,
            behavior_logprobs=-rng.random(completion.size).astype(np.float32),
            mu_logprobs=-rng.random(completion.size).astype(np.float32),
        ))
    write_records(directory, out, vocab_size=128, records_per_shard=8)


def train_yaml(*, steps: int, checkpoint_every: int, num_epochs: int | None = None) -> str:
    epochs = f", num_epochs: {num_epochs}" if num_epochs else ""
    return (
        "run_dir: run\nseed: 3\n"
        "model: {vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_layers: 1, "
        "num_heads: 2, num_kv_heads: 1, max_position_embeddings: 64}\n"
        "optim: {name: adamw, learning_rate: 1.0e-2}\nloss: {name: topr}\n"
        f"data: {{records: records, shuffle_seed: 5{epochs}}}\n"
        f"train: {{steps: {steps}, batch_size: 8, max_seq_len: 16, log_every: 2, "
        f"checkpoint_every: {checkpoint_every}, keep_checkpoints: 100, record_trace: true}}\n"
    )


ITERATE_YAML = (
    "run_dir: it\nseed: 1\n"
    "model: {vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_layers: 1, "
    "num_heads: 2, num_kv_heads: 1}\n"
    "loss: {name: topr}\n"
    "train: {steps: 3, batch_size: 8, max_seq_len: 160, log_every: 1, checkpoint_every: 1, "
    "keep_checkpoints: 100, record_trace: true}\n"
    "generate: {n: 4, max_new_tokens: 8, batch_size: 4, score_batch_size: 8}\n"
    "data: {task: arithmetic, num_prompts: 4}\n"
    "iterate: {iterations: 1, evaluate_initial: false, evaluate: false}\n"
)


@dataclass
class Reference:
    """What the uninterrupted run produced (filled by a stage's `reference` function)."""

    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Stage:
    name: str  # the scenario, e.g. "mid-step"
    args: list[str]  # the command (and its resume)
    setup: Callable[[Path, Path], None]  # (cwd, inputs root) -> lay out the inputs
    chosen: Callable[[int], Trigger] | None  # seed -> a chosen point; None: random only
    after_kill: Callable[[Path, Kill, Reference], list[str]]
    final: Callable[[Path, Reference], list[str]]
    reference: Callable[[Path, Reference], None]  # reads the uninterrupted run's outputs
    complete: Callable[[Path], bool] = lambda cwd: False  # True: nothing left to resume
    detail: str = ""
    random_only: bool = False  # every seed at a random point
    mixed: bool = False  # even seeds at a chosen point, odd seeds at a random one


def _exists(relative: str) -> Callable[[Path], bool]:
    return lambda cwd: (cwd / relative).exists()


def _glob(pattern: str) -> Callable[[Path], bool]:
    return lambda cwd: any(cwd.glob(pattern))


def _trace_reached(run: str, step: int) -> Callable[[Path], bool]:
    def fires(cwd: Path) -> bool:
        path = cwd / run / "record_trace.jsonl"
        return path.exists() and f'"step": {step},' in path.read_text()
    return fires


# -- train ----------------------------------------------------------------------------------

def _train_setup(records: str, yaml: str) -> Callable[[Path, Path], None]:
    def setup(cwd: Path, inputs: Path) -> None:
        shutil.copytree(inputs / records, cwd / "records")
        (cwd / "train.yaml").write_text(yaml)
    return setup


def _train_reference(cwd: Path, ref: Reference) -> None:
    ckpts = cwd / "run" / "checkpoints"
    ref.data["trace"] = checks.read_trace(cwd / "run")
    ref.data["records"] = checks.digests(cwd / "records")
    ref.data["states"] = {s: checks.checkpoint_state(ckpts, s)[1] for s in checks.committed_steps(ckpts)}


def _train_after_kill(cwd: Path, kill: Kill, ref: Reference, run: str = "run") -> list[str]:
    """The newest committed checkpoint is a whole one: it restores, bit-equal to the reference's
    state at that step. A graceful stop (143) checkpointed the step it stopped after."""
    ckpts = cwd / run / "checkpoints"
    steps = checks.committed_steps(ckpts)
    out = []
    if kill.returncode == 143:
        traced = max((int(r["step"]) for r in checks.read_trace(cwd / run)), default=0)
        if not steps or steps[-1] != traced:
            out.append(f"SIGTERM stop after step {traced} left checkpoints {steps}")
    if steps and steps[-1] in ref.data["states"]:  # a stop's own step: checked by the final state
        step, state = checks.checkpoint_state(ckpts)
        out += checks.state_failures(state, ref.data["states"][step], f"checkpoint {step} after the kill")
    return out


def _train_final(cwd: Path, ref: Reference, run: str = "run") -> list[str]:
    ckpts = cwd / run / "checkpoints"
    last = max(ref.data["states"])
    if last not in checks.committed_steps(ckpts):
        return [f"no final checkpoint {last} after the resume"]
    out = checks.state_failures(checks.checkpoint_state(ckpts, last)[1], ref.data["states"][last],
                                "final state")
    out += checks.trace_failures(cwd / run, ref.data["trace"], ref.data["records"])
    rows = [json.loads(x)["step"] for x in (cwd / run / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    if len(rows) != len(set(rows)):
        out.append(f"metrics.jsonl logs a step twice: {rows}")
    return out


def _train_stage(name: str, records: str, yaml: str, chosen: Callable[[int], Trigger],
                 detail: str, mixed: bool = False) -> Stage:
    return Stage(name, ["train", "--config", "train.yaml", "--no-progress"], _train_setup(records, yaml),
                 chosen, _train_after_kill, _train_final, _train_reference, detail=detail, mixed=mixed)


TRAIN_DETAIL = ("final train state (params, optimizer, step, RNG) bit-equal to the uninterrupted "
                "run's; each record once per epoch, same order; the newest checkpoint left by the "
                "kill restores bit-equal to the reference at its step")


def _step_trigger(steps: int) -> Callable[[int], Trigger]:
    def chosen(seed: int) -> Trigger:
        k = random.Random(seed).randint(1, steps)
        return Trigger(lambda cwd, t: _trace_reached("run", k)(cwd), f"at step {k}")
    return chosen


def _save_trigger(steps: int) -> Callable[[int], Trigger]:
    def chosen(seed: int) -> Trigger:
        k = random.Random(seed).randint(1, steps)
        return Trigger(lambda cwd, t: _glob(f"run/checkpoints/{k}.*tmp*")(cwd),
                       f"while checkpoint {k} is being written")
    return chosen


def _epoch_trigger(seed: int) -> Trigger:
    # 20 records, 8 a batch: batches 3, 5 and 8 hold the ends of epochs 0, 1 and 2.
    k = [3, 4, 5, 6, 8][seed % 5]
    return Trigger(lambda cwd, t: _trace_reached("run", k)(cwd), f"at step {k} (epoch boundary)")


def _epoch_end_trigger(seed: int) -> Trigger:
    # 24 records, 8 a batch, 2 epochs: checkpoint 3 ends epoch 0; the data runs out after 6.
    k = [4, 6][seed % 2]
    return Trigger(lambda cwd, t: _trace_reached("run", k)(cwd), f"at step {k} (num_epochs=2)")


def train_stages() -> list[Stage]:
    step_yaml = train_yaml(steps=8, checkpoint_every=2)
    return [
        _train_stage("train mid-step", "records20", step_yaml, _step_trigger(8),
                     f"at a seeded step of 8 (checkpoint every 2) or a random point; {TRAIN_DETAIL}",
                     mixed=True),
        _train_stage("train mid-async-save", "records20", train_yaml(steps=8, checkpoint_every=1),
                     _save_trigger(8), f"while Orbax writes a seeded step's checkpoint; {TRAIN_DETAIL}"),
        _train_stage("train at an epoch boundary", "records20", step_yaml, _epoch_trigger,
                     f"at the steps whose batch ends an epoch (20 records, batches of 8) and after; "
                     f"{TRAIN_DETAIL}"),
        _train_stage("train at the end of the data (num_epochs=2)", "records24",
                     train_yaml(steps=100, checkpoint_every=3, num_epochs=2), _epoch_end_trigger,
                     f"after a checkpoint on the epoch boundary and on the last batch; 6 steps "
                     f"trained, not 0 and not more; {TRAIN_DETAIL}"),
    ]


# -- one case ------------------------------------------------------------------------------

def run_reference(stage: Stage, inputs: Path, cwd: Path, env: dict[str, str]) -> Reference:
    """The uninterrupted run: its wall time and the outputs the cases compare with."""
    cwd.mkdir(parents=True)
    stage.setup(cwd, inputs)
    seconds, _ = cli(stage.args, cwd=cwd, env=env)
    ref = Reference(seconds)
    stage.reference(cwd, ref)
    return ref


def _trigger(stage: Stage, seed: int, attempt: int, ref: Reference) -> Trigger:
    chosen = stage.chosen is not None and not stage.random_only and not (stage.mixed and seed % 2)
    if chosen:
        return stage.chosen(seed + 1000 * attempt)
    # A delay that outlasted the run is drawn again, shorter.
    return after(random_delay(seed, ref.seconds) * 0.6 ** attempt)


def run_case(stage: Stage, ref: Reference, inputs: Path, root: Path, env: dict[str, str],
             sig: int, seed: int, attempts: int = 4) -> tuple[Kill | None, list[str]]:
    """Signal the command once (at the seed's point), check what the signal left, resume,
    check the result. Returns (the kill, failure messages); a failing case keeps its
    directory for inspection."""
    kill: Kill | None = None
    for attempt in range(attempts):
        cwd = root / f"{signal.Signals(sig).name}-{seed}-{attempt}"
        cwd.mkdir(parents=True)
        stage.setup(cwd, inputs)
        kill = interrupt(stage.args, cwd=cwd, env=env, sig=sig, trigger=_trigger(stage, seed, attempt, ref))
        if kill.landed:
            break
        shutil.rmtree(cwd)
    else:
        return kill, [f"seed {seed}: the signal never reached a running process in {attempts} "
                      f"tries ({kill.describe() if kill else ''})"]
    fails = [] if expected_exit(kill) else [f"exit {kill.returncode}:\n{kill.output[-1500:]}"]
    try:
        fails += stage.after_kill(cwd, kill, ref)
        if not stage.complete(cwd):
            cli(stage.args, cwd=cwd, env=env)
        fails += stage.final(cwd, ref)
    except Exception as err:  # a crash of the check or the resume fails the case
        fails.append(f"{type(err).__name__}: {err}")
    if not fails:
        shutil.rmtree(cwd)
    return kill, [f"seed {seed}, {kill.describe()}: {f}" for f in fails]
