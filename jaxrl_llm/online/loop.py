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

This module holds the round's pieces every mode shares (the config checks, `RunState` and its
checkpoint meta, μ, `shared_rewards`); `run_online` runs the one rounds driver,
`pipeline.train_rounds`, with the sampler on this policy (`pipeline.run_serial`): the
pipelines, free-running and the storage trainer run the same driver with other placements.

Multi-host (docs/online.md § Multi-host): every process runs this loop on the same prompts
with the same seeds over one global mesh; process 0's rewards are broadcast (`shared_rewards`)
and process 0 alone writes metrics and the checkpoint's JSON meta (Orbax's JSON handler).
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.config import ConfigError
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.pipeline import run_serial
from jaxrl_llm.online.run_state import (  # the names this module has always offered
    ONLINE_META,
    EvalHook,
    OnlineResult,
    RunState,
    check_config,
    experiment_of,
    restore_run,
    round_mu,
    shared_rewards,
    untruncated,
)

__all__ = ["ONLINE_META", "EvalHook", "OnlineResult", "RunState", "check_config",
           "experiment_of", "restore_run", "round_mu", "run_online", "shared_rewards",
           "untruncated"]


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

    return run_serial(config, progress=progress, mesh=mesh, eval_hook=eval_hook,
                      eval_every=eval_every, eval_at_start=eval_at_start)
