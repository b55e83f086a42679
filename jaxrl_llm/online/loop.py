"""`jaxrl-llm online`: the online loop on one policy (docs/online.md).

Round i (0-based) of `online.rounds + ⌈staleness / updates_per_round⌉`:

1. sample `generate.n` completions of the next `online.prompts_per_round` prompts with the
   current weights (`Policy.rollout`: the KV-cache sampler reads the train state's params;
   nothing is exported, reloaded or re-jitted) and reward them with the task's verifier;
2. μ (losses that read it): the sampler's log-probs, or a re-score with the trainer's
   numerics right after sampling, i.e. by the same weights (`online.mu_source`);
3. the group transform (`data.group_transform`: rloo, grpo, dr_grpo, pkpo with k from
   `online.pkpo_k`) over the round's groups;
4. the round's records, split into `updates_per_round` batches, join the staleness queue
   (online/queue.py); every batch the queue releases is one `train_step` update;
5. metrics (reward, pass@k, loss metrics, μ mismatch, seconds per phase) to JSONL /
   TensorBoard / wandb, and a checkpoint every `online.checkpoint_every` rounds holding the
   train state (params, optimizer, step, RNG), the queue's records (their own item) and, in
   its JSON meta, the round and the prompt position. A killed run re-run with the same
   command resumes from it and ends in the same state as an uninterrupted one (sampling seeds
   derive from the round).

Multi-host (docs/online.md § Multi-host): every process runs this loop on the same prompts
with the same seeds over one global mesh; process 0's rewards are broadcast (`shared_rewards`)
and process 0 alone writes metrics and the checkpoint's JSON meta (Orbax's JSON handler).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_llm.api import Policy, load_policy, restore_state, transform_rewards
from jaxrl_llm.config import ConfigError, ExperimentConfig
from jaxrl_llm.core.paths import as_path
from jaxrl_llm.core.progress import progress_bar
from jaxrl_llm.data.records import Record
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.queue import QUEUE_ITEM, StalenessQueue
from jaxrl_llm.online.rounds import (
    k_for_round,
    logprob_mismatch,
    mean_metrics,
    probe,
    probe_start,
    prompt_slice,
    reward_metrics,
    sampling_seed,
    split_batches,
)
from jaxrl_llm.online.sampler_shape import fixed_sampler_batch
from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR, Checkpointer
from jaxrl_llm.train.metrics_log import MetricsLogger
from jaxrl_llm.train.preemption import StopSync
from jaxrl_llm.train.preflight import check_rows_fit_model
from jaxrl_llm.train.state_items import state_items

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
        metrics = logprob_mismatch([r.raw_logprobs for r in records], mu)
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


def run_online(config: OnlineConfig, *, progress: bool = True, mesh: Any = None,
               eval_hook: EvalHook | None = None, eval_every: int = 0,
               eval_at_start: bool = False) -> OnlineResult:
    """Run (or resume) the online loop of `config` (module docstring) on `mesh` (default:
    the `mesh:` section over every device). `eval_hook(updates, policy)`, with
    `eval_every` > 0, is called at the end of every round whose update count reached a new
    multiple of `eval_every` (and after the last update), and with `eval_at_start` before the
    first round of a fresh run (a row at step 0); the numbers it returns join that round's
    metrics row as `eval/KEY` (`jaxrl-llm online` builds it from `train.eval_every` and the
    `eval:` section). SIGTERM / Ctrl-C stop the run after the current round, checkpointed
    (`OnlineResult.stopped`); the same call resumes."""
    if eval_hook is not None and eval_every <= 0:
        raise ValueError(f"eval_every={eval_every}: an eval_hook needs eval_every > 0")
    if config.online.pipeline != "off" or config.online.sampler_devices:
        raise ConfigError("online.pipeline / online.sampler_devices place the sampler on its "
                          "own devices: run it with jaxrl_llm.online.pipeline.run_pipeline "
                          "(`jaxrl-llm online` does)")

    check_config(config)
    o, g, d = config.online, config.generate, config.data
    experiment = experiment_of(config)
    policy = load_policy(config=experiment, mesh=mesh)
    problems = policy.task.load(split=g.split, num=d.num_prompts, seed=config.seed)
    total_updates = o.rounds * o.updates_per_round
    total_rounds = o.rounds + math.ceil(o.staleness / o.updates_per_round)
    run = RunState(o.staleness)
    checkpointer = Checkpointer(as_path(config.run_dir) / CHECKPOINT_DIR, save_every=o.checkpoint_every,
                                keep=config.train.keep_checkpoints, async_save=False,
                                params_dtype=config.train.checkpoint_dtype)
    if checkpointer.latest_step() is not None:
        restore_run(policy, checkpointer, run)
    run.fix_sampler_batch(config, policy, problems)
    lead = jax.process_index() == 0
    logger = MetricsLogger(config.run_dir, resume_step=run.round, enabled=lead,
                           wandb=config.metrics, run_name=config.name,
                           run_config=config.model_dump(mode="json"))
    bar = progress_bar(total_rounds, desc="online", unit="round", enabled=progress and lead,
                       initial=run.round)
    last: dict[str, Any] = {}
    # every process stops after the same round (train/preemption.py)
    stop = StopSync(what="the current round and its checkpoint")
    stop.install()
    stopped, saved = False, checkpointer.latest_step()
    try:
        numbers = probe_start(eval_hook, eval_at_start, policy, run.round, total_updates)
        if numbers:  # none when a Ctrl-C stopped it: no empty row
            last = logger.log(0, numbers)
        while run.round < total_rounds and not stopped:
            t0 = time.perf_counter()
            picked = [problems[i] for i in prompt_slice(run.position, o.prompts_per_round,
                                                        len(problems))]
            records = policy.rollout(picked, n=g.n, seed=sampling_seed(config.seed, run.round),
                                     group_offset=run.round * o.prompts_per_round)
            records = shared_rewards(records)
            t1 = time.perf_counter()
            metrics = reward_metrics(records, g.n, o.pass_k)
            records, mismatch = round_mu(policy, config, run, records)
            t2 = time.perf_counter()
            k = k_for_round(o.pkpo_k, d.pkpo_k, run.round)
            records = transform_rewards(records, d.group_transform, k=k)
            for batch in split_batches(records, o.updates_per_round):
                run.queue.push(batch)
            steps = []
            while run.queue.ready() and run.updates < total_updates:
                steps.append(policy.step(run.queue.pop()))
                run.updates += 1
            t3 = time.perf_counter()
            run.round += 1
            run.position = (run.position + o.prompts_per_round) % len(problems)
            metrics.update(mismatch)
            metrics.update(mean_metrics(steps))
            metrics.update(probe(eval_hook, eval_every, policy, run.updates - len(steps),
                                 run.updates, total_updates))
            metrics.update(updates=run.updates, round_updates=len(steps), queued=len(run.queue),
                           mu_from_sampler=float(run.mu_source == "sampler"),
                           seconds_sampling=t1 - t0, seconds_scoring=t2 - t1,
                           seconds_training=t3 - t2, **({"pkpo_k": k} if k else {}))
            last = logger.log(run.round, metrics)
            # The postfix first, without a redraw: one line per round in a log.
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", updates=run.updates,
                            refresh=False)
            bar.update(1)
            stopped = stop.should_stop(run.round) and run.round < total_rounds
            if checkpointer.should_save(run.round) or run.round == total_rounds or stopped:
                checkpointer.save(run.round, state_items(policy.state), force=True, meta={
                    "config": experiment.model_dump(mode="json"), ONLINE_META: run.meta()},
                    blobs=run.blobs())
                saved = run.round
    finally:
        stop.uninstall()
        bar.close()
        logger.close()
        checkpointer.close()
    return OnlineResult(
        rounds=run.round, updates=run.updates, last=last, policy=policy, stopped=stopped,
        stop_signal=stop.signum if stopped else None,
        checkpoint=None if saved is None else str(checkpointer.directory / str(saved)))
