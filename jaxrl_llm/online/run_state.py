"""What every mode of `jaxrl-llm online` shares (docs/online.md): the config checks, the run's
position and its checkpoint meta (`RunState`, `restore_run`, `ONLINE_META`), the result type,
μ for a round's records (`round_mu`) and process 0's rewards on every host
(`shared_rewards`). The rounds themselves run in `driver.drive` (`loop.run_online`, the
pipelines, the storage trainer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_llm.api import Policy, restore_state
from jaxrl_llm.config import ConfigError, ExperimentConfig
from jaxrl_llm.data.records import Record
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.queue import QUEUE_ITEM, StalenessQueue
from jaxrl_llm.online.rounds import (
    k_for_round,
    logprob_mismatch,
)
from jaxrl_llm.online.sampler_shape import fixed_sampler_batch
from jaxrl_llm.train.preflight import check_rows_fit_model

ONLINE_META = "online"


@dataclass
class OnlineResult:
    rounds: int  # rounds run in total (this process and the ones it resumed)
    updates: int  # optimizer updates applied
    last: dict[str, Any]  # the last round's metrics row
    policy: Policy
    stopped: bool = False  # a SIGTERM / Ctrl-C stopped it after a round, checkpointed
    stop_signal: int | None = None
    checkpoint: str | None = None  # the checkpoint the run ended on (resume from it)


def check_config(config: OnlineConfig) -> None:
    """Refuse what the loop cannot do, naming the key."""
    o, g, t = config.online, config.generate, config.train
    spec = config.loss.spec
    records = o.prompts_per_round * g.n
    if records != o.updates_per_round * t.batch_size:
        raise ConfigError(
            f"online.prompts_per_round × generate.n = {o.prompts_per_round} × {g.n} = {records} "
            f"records per round must equal online.updates_per_round × train.batch_size = "
            f"{o.updates_per_round} × {t.batch_size}")
    if t.batch_size % g.n:
        raise ConfigError(f"train.batch_size={t.batch_size} must be a multiple of generate.n="
                          f"{g.n} (a batch holds whole groups)")
    if g.backend != "jax" and not o.exchange:
        raise ConfigError("generate.backend must be jax for online (the sampler shares the "
                          "trainer's weights); vLLM samples as a rollout worker of a storage "
                          "pipeline (online.exchange, docs/online.md § Pipeline)")
    if spec.needs_pairs:
        raise ConfigError(f"loss.name={config.loss.name} trains on (chosen, rejected) pairs "
                          "from curate; online has none: pick a policy-gradient loss")
    if spec.needs_ref and t.ref_logprobs == "batch":
        raise ConfigError(f"loss.name={config.loss.name} reads π_ref: set "
                          "train.ref_logprobs=model for online (the frozen policy in the step)")
    if config.data.pack:
        raise ConfigError("data.pack=true is not supported by online (batches are one group "
                          "per row set); set data.pack=false")
    if config.data.group_transform == "pkpo" and k_for_round(o.pkpo_k, config.data.pkpo_k, 0) is None:
        raise ConfigError("data.group_transform=pkpo needs online.pkpo_k or data.pkpo_k")
    for k in [*(o.pkpo_k or []), *([config.data.pkpo_k] if config.data.pkpo_k else [])]:
        if k > g.n:
            raise ConfigError(f"PKPO k={k} (online.pkpo_k / data.pkpo_k) exceeds generate.n={g.n}")
    if o.mu_source == "sampler" and spec.needs_mu and not untruncated(config):
        raise ConfigError("online.mu_source=sampler needs untruncated sampling (generate.top_k=0, "
                          "top_p=1, temperature>0): the sampler's log-probs are otherwise not "
                          "the policy's; use trainer or auto")
    check_rows_fit_model(config)  # train.max_seq_len within the model's context


def untruncated(config: ExperimentConfig) -> bool:
    g = config.generate
    return g.top_k == 0 and g.top_p == 1.0 and g.temperature > 0


def experiment_of(config: OnlineConfig) -> ExperimentConfig:
    """The experiment the policy trains with: `train.steps` = every update of the run (the
    learning-rate schedule's length)."""
    o = config.online
    data = config.model_dump(include=set(ExperimentConfig.model_fields))
    data["train"]["steps"] = o.rounds * o.updates_per_round
    return ExperimentConfig.model_validate(data)


class RunState:
    """The loop's mutable position (what a checkpoint's meta holds besides the state)."""

    def __init__(self, staleness: int) -> None:
        self.round = 0
        self.position = 0
        self.updates = 0
        self.mu_source: str | None = None
        self.queue = StalenessQueue(staleness)
        self.sampler_batch: int | None = None  # fixed once per run (online/sampler_shape.py)

    def meta(self) -> dict[str, Any]:
        return {"round": self.round, "prompt_position": self.position, "updates": self.updates,
                "mu_source": self.mu_source, "sampler_batch": self.sampler_batch}

    def blobs(self) -> dict[str, bytes]:
        """The checkpoint's items beside the meta: the queued records (online/queue.py)."""
        return {QUEUE_ITEM: self.queue.to_bytes()}

    def load(self, meta: dict[str, Any], queue: bytes | None = None, *,
             where: str = "checkpoint") -> None:
        self.round, self.position = int(meta["round"]), int(meta["prompt_position"])
        self.updates, self.mu_source = int(meta["updates"]), meta["mu_source"]
        self.queue = StalenessQueue.from_checkpoint(self.queue.staleness, queue, meta,
                                                    where=where)
        batch = meta.get("sampler_batch")  # absent: a checkpoint from before it was recorded
        self.sampler_batch = None if batch is None else int(batch)

    def fix_sampler_batch(self, config: OnlineConfig, policy: Policy, problems: list[Any],
                          *, in_flight: int = 0) -> None:
        """`policy` samples every round with the run's prompt batch: the one recorded in the
        checkpoint, or decided now (`sampler_shape.fixed_sampler_batch`)."""
        if self.sampler_batch is None:
            self.sampler_batch = fixed_sampler_batch(config, policy, problems,
                                                     in_flight=in_flight)
        policy.sampler_batch = self.sampler_batch


def restore_run(policy: Policy, checkpointer: Any, run: RunState) -> None:
    """`policy`'s state and `run`'s position from the newest checkpoint (every mode's)."""
    step = checkpointer.latest_step()
    policy.state = restore_state(policy.state, str(checkpointer.directory), step=step)
    run.load(checkpointer.read_meta(step)[ONLINE_META], checkpointer.read_blob(QUEUE_ITEM, step),
             where=str(checkpointer.directory / str(step) / QUEUE_ITEM))


def round_mu(policy: Policy, config: OnlineConfig, run: RunState, records: list[Any]
             ) -> tuple[list[Any], dict[str, float]]:
    """Records with μ set (sampler's or re-scored), and the mismatch metrics when scored."""
    o = config.online
    if not config.loss.spec.needs_mu and o.mu_source != "trainer":
        return records, {}
    if run.mu_source is None:
        run.mu_source = o.mu_source if o.mu_source != "auto" else (
            "check" if untruncated(config) else "trainer")
    metrics: dict[str, float] = {}
    if run.mu_source in ("trainer", "check"):
        size = config.train.batch_size
        mu = [m for i in range(0, len(records), size) for m in policy.score(records[i:i + size])]
        metrics = logprob_mismatch([r.raw_logprobs for r in records], mu,
                                   [r.model_tokens() for r in records])
        if run.mu_source == "check":  # auto, first round: decided once, kept in checkpoints
            run.mu_source = ("sampler" if metrics["mu_mismatch_max"] <= o.max_mu_mismatch
                             else "trainer")
        if run.mu_source == "trainer":
            return [r.replace(mu_logprobs=m) for r, m in zip(records, mu)], metrics
    return [r.replace(mu_logprobs=r.raw_logprobs) for r in records], metrics


def shared_rewards(records: list[Record]) -> list[Record]:
    """`records` with process 0's reward, raw_reward, correct and invalid (multi-host: every
    process holds the same completions). Broadcast, not recomputed everywhere: a verifier
    with a wall-clock timeout (tasks/math_task.py) may score one completion differently on
    two busy hosts, and the hosts' batches would then disagree."""
    if jax.process_count() == 1:
        return records

    table = np.asarray([[r.reward, np.nan if r.raw_reward is None else r.raw_reward,
                         r.correct, r.invalid] for r in records], np.float64)
    # float64 as uint32 pairs: jax (x64 off) would round floats to float32 on the way.
    table = np.asarray(multihost_utils.broadcast_one_to_all(table.view(np.uint32)),
                       np.uint32).view(np.float64)
    return [r.replace(reward=float(a), raw_reward=None if np.isnan(b) else float(b),
                      correct=bool(c), invalid=bool(i))
            for r, (a, b, c, i) in zip(records, table, strict=True)]


EvalHook = Callable[[int, Policy], dict[str, float]]
