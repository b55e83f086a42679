"""The trainer: a thin loop around the one jitted `train_step` (docs/architecture.md § The flow).

    records (grain BatchLoader) ─▶ global sharded Batch ─▶ train_step ─▶ metrics window
          ▲                                                   │
          └── iterator position ◀── Orbax checkpoint ◀── state (params, opt, step, rng)

- Metrics: every step's scalars go into a `MetricWindow`; every `train.log_every` steps one
  row (means, sums for counts, plus throughput) goes to `metrics.jsonl` and TensorBoard.
  Step N's metrics are read after step N+1 is dispatched (`fetch_metrics`), so the host
  never waits on the device inside the loop; checkpoint metadata is built only on saves.
- Checkpoints (`train/checkpoint.py`): every `train.checkpoint_every` steps (async) and at
  the end; the loop step, the grain iterator position and the resolved config are saved
  with the state, so a resumed run consumes the same records and ends with the same
  parameters as an uninterrupted one (deterministic given the seeds).
- Resume: a `Trainer` whose `run_dir/checkpoints` holds a committed checkpoint continues
  from the latest one.
- SIGTERM (preemption) or Ctrl-C: the loop finishes the current step, checkpoints, and
  returns with `stopped=True` (the `train` command then exits with 143, or 130 for Ctrl-C;
  `jaxrl_llm/core/signals.py`). With several processes the stop step is agreed through a sync
  point (`train/preemption.py`), so all hosts save together.
- Non-finite steps are skipped by the step itself; `train.max_nonfinite_steps` consecutive
  ones stop the run with an error naming the step and the first non-finite quantity (never
  train on NaN); rows carry `train/nonfinite_skips` and `train/consecutive_nonfinite`
  (`train/nonfinite.py`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from jaxrl_llm.config import ExperimentConfig, dump_config
from jaxrl_llm.core.atomic import atomic_write_text
from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.core.paths import PathLike, as_path
from jaxrl_llm.core.progress import progress_bar, set_status
from jaxrl_llm.core.signals import Interrupted
from jaxrl_llm.data.loader import loader_from_config
from jaxrl_llm.data.signal import check_signal
from jaxrl_llm.data.stages import check_mu, stage_input
from jaxrl_llm.losses.types import finite_or_raise
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR, Checkpointer, abstract_like, warn_if_rounded
from jaxrl_llm.train.metrics_log import MetricsLogger
from jaxrl_llm.train.nonfinite import NonfiniteGuard, nonfinite_quantities
from jaxrl_llm.train.preemption import StopSync
from jaxrl_llm.train.preflight import (
    check_all_records,
    check_batch_divides,
    check_records,
    check_rows_fit_model,
    first_step_metrics,
    model_vocab_size,
)
from jaxrl_llm.train.record_trace import RecordTrace
from jaxrl_llm.train.state import abstract_train_state, create_train_state
from jaxrl_llm.train.state_items import STATE_FIELDS, state_items, with_items  # noqa: F401 (re-exported)
from jaxrl_llm.train.step import make_train_step
from jaxrl_llm.train.step_fit import fit_train_step
from jaxrl_llm.train.window import MetricWindow
from jaxrl_llm.weights.loading import check_weights_found, decoder_config

# (step, state) -> metrics to log under "eval/" (or None)
EvalHook = Callable[[int, Any], Mapping[str, float] | None]
# (step, host batch) -> None: sees every batch before it is trained on (tests, data audits)
BatchHook = Callable[[int, Any], None]
# (step, trainer) -> None: after each step (tests, custom schedules)
StepHook = Callable[[int, "Trainer"], None]

# Kernel metrics that compare π with μ: meaningless (μ = 0) when the loss reads no μ
# (`LossSpec.needs_mu` false in losses/registry.py).
RATIO_METRICS = ("loss/log_ratio", "loss/ess", "loss/clip_frac")

@dataclass(frozen=True)
class TrainResult:
    step: int  # loop steps completed (train steps called)
    state: Any  # final TrainState
    stopped: bool  # True when SIGTERM or Ctrl-C stopped the run early (checkpointed)
    run_dir: epath.Path
    checkpoint_dir: epath.Path
    metrics_path: epath.Path
    last_row: dict[str, Any]
    stop_signal: int | None = None  # the signal that stopped it (None: a request or JAX's sync)


class Trainer:
    """Trains `config` on the records in `records` (default: data.curated, else the scored
    records, else data.records; `data.stages.stage_input`) into `run_dir`
    (default `config.run_dir`); see the module docstring. `refuse_no_signal`: records that
    give the loss nothing to learn are refused unless `train.allow_no_signal` (else a
    warning; data/signal.py). With `train.eval_every`, `eval_hook` runs every `eval_every`
    steps and after the last step (and at step 0 of a fresh run with `eval_at_start`); each
    evaluation is its own metrics row at its own step."""

    def __init__(
        self,
        config: ExperimentConfig,
        *,
        records: PathLike | None = None,
        run_dir: PathLike | None = None,
        model: Any | None = None,
        mesh: Any | None = None,
        eval_hook: EvalHook | None = None,
        on_batch: BatchHook | None = None,
        on_step: StepHook | None = None,
        progress: bool = True,
        tensorboard: bool = True,
        init_from: PathLike | None = None,
        refuse_no_signal: bool = False,
        eval_at_start: bool = False,
    ) -> None:
        self.config = config
        # The configuration first (mesh, batch split, model source), then the data: a wrong
        # config must not wait behind a long check of every record.
        self.mesh = mesh if mesh is not None else make_mesh(config.mesh)
        check_batch_divides(config, self.mesh)
        if model is None:  # a missing or unreadable model.path, named

            check_weights_found(config.model)
            decoder_config(config.model)
        check_rows_fit_model(config, model)  # before any weights load
        if config.train.eval_every and eval_hook is None:  # never accepted and ignored

            raise ConfigError(
                f"train.eval_every={config.train.eval_every} needs an evaluation: `jaxrl-llm "
                "train` builds one (eval.* keys); from Python pass Trainer(eval_hook=...); "
                "`iterate` evaluates after each iteration instead: unset train.eval_every")
        # `records` wins; else data.curated, the scored records, data.records (data/stages.py).
        self.records = stage_input(config, "train", records)
        # Refuse records this loss cannot train on (μ, reference log-probs, μ's temperature).
        check_mu(config, self.records)
        self.config = config = check_records(config, self.records)
        check_all_records(self.records, model_vocab_size(config),  # every record, before step 1
                          process_index=jax.process_index(), process_count=jax.process_count())
        # No positives / all-equal groups: a warning, or with `refuse_no_signal` (`jaxrl-llm
        # train`) a ConfigError unless train.allow_no_signal (data/signal.py).
        warning = check_signal(config, self.records, refuse=refuse_no_signal)
        if warning and jax.process_index() == 0:
            print(warning, file=sys.stderr)
        self.run_dir = as_path(run_dir if run_dir is not None else config.run_dir)
        self.eval_hook, self.on_batch, self.on_step = eval_hook, on_batch, on_step
        self.eval_at_start = eval_at_start
        if config.train.record_trace:  # data-order audit (train/record_trace.py)

            self.on_batch = RecordTrace(self.run_dir, then=on_batch)
        self.progress = progress and jax.process_index() == 0
        self.tensorboard = tensorboard
        self._model = model
        # A previous run's checkpoints: its train state seeds this run (see `_initial_state`).
        self.init_from = init_from
        self._stop = StopSync()

        self.uses_mu = config.loss.spec.needs_mu
        # The one loader constructor: pairs, whole groups and μ as the loss's LossSpec needs.
        self.loader = loader_from_config(config, self.records)
        self.checkpoint_dir = self.run_dir / CHECKPOINT_DIR
        self.checkpointer = Checkpointer(
            self.checkpoint_dir,
            save_every=config.train.checkpoint_every,
            keep=config.train.keep_checkpoints,
            params_dtype=config.train.checkpoint_dtype,
        )

    # -- state -----------------------------------------------------------------------------

    def _initial_state(self) -> tuple[Any, int]:
        """(state, loop step): restored from the latest checkpoint when there is one; else,
        with `init_from`, that run's final train state (parameters, optimizer state and step,
        RNG; not its data position) at loop step 0, so the optimizer continues (`iterate`)."""
        latest = self.checkpointer.latest_step()
        # Without a given model, every source loads through `weights.loading` (weights straight
        # into their shardings; a resume builds only the abstract template).
        if latest is None and self.init_from is None:
            return create_train_state(self.config, self.mesh, self._model), 0
        if self._model is None:
            template = abstract_train_state(self.config, self.mesh)
        else:
            template = create_train_state(self.config, self.mesh, self._model)
        items = state_items(template)
        shardings = {k: _shardings(v) for k, v in items.items()}
        if latest is None:
            return continue_state(template, self.init_from, self._model is not None), 0
        restored = self.checkpointer.restore(
            abstract_like(items, shardings), step=latest, data_iterator=self.loader
        )
        warn_if_rounded(restored.meta, f"resuming {self.run_dir} at step {latest}")
        return with_items(template, restored.state), int(restored.meta["step"])

    def _meta(self, step: int, state: Any) -> dict[str, Any]:
        return {
            "step": step,
            "optimizer_step": int(np.asarray(state.step)),
            "records": self.records,
            # Only the ExperimentConfig part (subclass configs add sections of their own).
            "config": self.config.model_dump(mode="json",
                                             include=set(ExperimentConfig.model_fields)),
        }

    # -- the loop ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop after the current step, checkpointing first (what SIGTERM does)."""
        self._stop.request()

    def run(self) -> TrainResult:
        cfg = self.config.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            atomic_write_text(self.run_dir / "config.yaml", dump_config(self.config))
        state, step = self._initial_state()
        # Before anything is logged: the first batch, and the step compiled for it and
        # checked against the memory left (`_fit_step`), so a step that cannot fit never starts.
        first = self._next_batch() if step < cfg.steps else None
        train_step = (cached_train_step(self.config, self.mesh, state) if first is None
                      else self._fit_step(state, global_batch(first, self.mesh)))
        logger = MetricsLogger(self.run_dir, resume_step=step if step else None,
                               tensorboard=self.tensorboard, enabled=jax.process_index() == 0,
                               wandb=self.config.metrics, run_name=self.config.name,
                               run_config=self._meta(step, state)["config"])
        self._stop.install()  # SIGTERM / Ctrl-C stop after a step (train/preemption.py)
        window = MetricWindow()

        bar = progress_bar(cfg.steps, initial=step, enabled=self.progress, desc="train",
                           unit="step")
        last_row: dict[str, Any] = {}
        guard = NonfiniteGuard(nonfinite_quantities(state.params), cfg.max_nonfinite_steps)
        tokens, steps_in, t_window = 0, 0, time.perf_counter()
        # (step, device metrics, host metrics, eval metrics, the step's tokens)
        pending: tuple | None = None

        def consume(at: int, metrics: Any, data: dict[str, float],
                    extra: Mapping[str, float] | None, step_tokens: int) -> dict[str, Any] | None:
            """Fold step `at`'s metrics into the window; log a row when one is due."""
            nonlocal tokens, steps_in, t_window
            # Counted here, when the step's metrics are read (it has run), not at dispatch:
            # a row's tokens and its time window then cover the same steps.
            tokens += step_tokens
            steps_in += 1
            scalars = {k: float(v) for k, v in fetch_metrics(metrics).items()
                       if self.uses_mu or not k.startswith(RATIO_METRICS)}
            scalars.update(data)
            guard.observe(at, scalars)  # raises after max_nonfinite_steps skips in a row
            if at == 1:  # the first row shows step 1's log-ratios (≈ 0: π = μ = π_ref)

                scalars.update(first_step_metrics(scalars))
            window.add(scalars)
            bar.set_postfix(loss=f"{scalars['loss']:.4g}", refresh=False)
            # An evaluation ends the window: its numbers (an SE among them) are its step's
            # own, never averaged with another evaluation's.
            if at % cfg.log_every and at != cfg.steps and not extra:
                bar.update(1)
                return None
            elapsed = max(time.perf_counter() - t_window, 1e-9)
            row = {**window.flush(), **guard.metrics(),
                   **{f"eval/{k}": float(v) for k, v in (extra or {}).items()}}
            row["throughput/tokens_per_s"] = tokens / elapsed
            row["throughput/steps_per_s"] = steps_in / elapsed
            bar.set_postfix(loss=f"{row['loss']:.4g}",
                            tok_s=f"{row['throughput/tokens_per_s']:.0f}", refresh=False)
            bar.update(1)
            if not bar.disable and bar.last_print_n != bar.n:  # a line per logged row, one only
                bar.refresh()
            tokens, steps_in, t_window = 0, 0, time.perf_counter()
            return logger.log(at, row)

        def evaluate(at: int, state: Any) -> dict[str, float]:
            # The bar counts steps one late (see below): say what the wait is for.
            set_status(bar, f"evaluating step {at}", now=True)
            try:
                return dict(self.eval_hook(at, state) or {})
            except Interrupted:  # Ctrl-C inside it: noted, so the loop stops after this step
                return {}

        evaluating = bool(cfg.eval_every and self.eval_hook)
        try:
            if evaluating and self.eval_at_start and step == 0 and step < cfg.steps:
                numbers = evaluate(0, state)
                if numbers:  # none when a Ctrl-C stopped it: no empty row
                    last_row = logger.log(0, {f"eval/{k}": float(v) for k, v in numbers.items()})
            stopped = False
            while step < cfg.steps and not stopped:
                host, first = (first, None) if first is not None else (self._next_batch(), None)
                if host is None:  # data.num_epochs exhausted before train.steps
                    break
                if self.on_batch is not None:
                    self.on_batch(step + 1, host)
                step_tokens = int(np.count_nonzero(host.segment_ids)) * jax.process_count()
                state, metrics = train_step(state, global_batch(host, self.mesh))
                step += 1
                extra = None
                if evaluating and (step % cfg.eval_every == 0 or step == cfg.steps):
                    extra = evaluate(step, state)
                # Step N's metrics are read once step N+1 is queued behind it, so the host never
                # waits for the device inside the loop: logging, the non-finite stop and the
                # bar run one step late (the stop raises at most one step later).
                if pending is not None:
                    last_row = consume(*pending) or last_row
                pending = (step, metrics, batch_data_metrics(self.loader, host), extra,
                           step_tokens)
                # Checkpoint metadata (a device read of the optimizer step) only when due.
                if self.checkpointer.should_save(step):
                    self.checkpointer.save(step, state_items(state), data_iterator=self.loader,
                                           meta=self._meta(step, state))
                if self.on_step is not None:
                    self.on_step(step, self)
                # Every process asks at every step; all get the same answer at the same step.
                stopped = self._stop.should_stop(step) and step < cfg.steps
            if pending is not None:
                last_row = consume(*pending) or last_row
            if len(window):
                last_row = logger.log(step, {**window.flush(), **guard.metrics()})
            self.checkpointer.save(step, state_items(state), data_iterator=self.loader,
                                   meta=self._meta(step, state), force=True)
            self.checkpointer.wait()
        finally:
            # Handlers first: wandb's finish() (in logger.close) loses its last rows under ours.
            self._stop.uninstall()
            bar.close()
            logger.close()
        return TrainResult(
            step=step, state=state, stopped=stopped, run_dir=self.run_dir,
            checkpoint_dir=self.checkpoint_dir, metrics_path=logger.path,
            last_row=last_row, stop_signal=self._stop.signum if stopped else None,
        )

    def _next_batch(self) -> Any | None:
        """The loader's next host batch, checked finite (never train on NaN); None at the end
        of the data (`data.num_epochs`)."""
        try:
            host = next(self.loader)
        except StopIteration:
            return None
        finite_or_raise(rewards=host.rewards, mu_logprobs=host.mu_logprobs,
                        behavior_logprobs=host.behavior_logprobs, ref_logprobs=host.ref_logprobs)
        return host

    def _fit_step(self, state: Any, batch: Any) -> Any:
        """The jitted step, compiled for the largest batch and checked against the memory
        left (`train/step_fit.py`); a micro-batch size it picks becomes this run's config."""
        say = None if jax.process_index() == 0 else (lambda text: None)
        if self.progress:  # the compile takes a while on a real model: say what is happening
            print("train: compiling the train step", file=sys.stderr, flush=True)
        self.config, step, _ = fit_train_step(
            self.config, self.mesh, state, batch,
            lambda config: cached_train_step(config, self.mesh, state), say=say)
        return step

    def close(self) -> None:
        self.checkpointer.close()


# Config keys the train step never reads: runs differing only in these share one compiled step.
_STEP_IRRELEVANT: dict[str, Any] = {
    "name": True, "run_dir": True, "data": True, "eval": True, "plan": True,
    "train": {"log_every", "checkpoint_every", "keep_checkpoints", "checkpoint_dtype", "eval_every",
              "max_nonfinite_steps", "record_trace", "check_memory"},
}
_STEP_CACHE: dict[Any, Any] = {}
_STEP_CACHE_SIZE = 4


def cached_train_step(config: ExperimentConfig, mesh: Any, state: Any) -> Any:
    """`make_train_step`, reused across Trainers of one process (the `iterate` loop and
    resumed runs) when the step-relevant config, mesh, state structure and shardings match,
    so a new Trainer does not recompile."""
    leaves, treedef = jax.tree.flatten(state)
    key = (
        config.model_dump_json(exclude=_STEP_IRRELEVANT), mesh, treedef,
        tuple((x.shape, str(x.dtype), x.sharding) for x in leaves),
    )
    if key not in _STEP_CACHE:
        while len(_STEP_CACHE) >= _STEP_CACHE_SIZE:
            _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
        _STEP_CACHE[key] = make_train_step(config, mesh, state)
    return _STEP_CACHE[key]


def fetch_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The train step's metrics on the host (the loop's only device read per step; it reads
    step N's after step N+1 is dispatched)."""
    return jax.device_get(dict(metrics))


def continue_state(template: Any, checkpoints: PathLike, keep_ref: bool) -> Any:
    """`template` with the latest train state saved in `checkpoints` (a run's checkpoint
    directory): parameters, optimizer state and step, RNG. `keep_ref`: the template's
    reference policy stays (it is the model this run was given)."""
    items = state_items(template)
    source = Checkpointer(checkpoints, async_save=False)
    try:
        if source.latest_step() is None:
            raise FileNotFoundError(f"init_from={checkpoints}: no complete checkpoint to "
                                    f"continue from (train that run first)")
        target = abstract_like(items, {k: _shardings(v) for k, v in items.items()})
        found = source.restore(target)
        warn_if_rounded(found.meta, f"continuing from {checkpoints}")
        restored = dict(found.state)
    finally:
        source.close()
    if keep_ref and "ref_params" in items:
        restored["ref_params"] = items["ref_params"]
    return with_items(template, restored)


def batch_data_metrics(loader: Any, host: Any) -> dict[str, float]:
    """What the global batch holds, host-side: `data/whole_groups` / `data/partial_groups`
    for the group losses (summed over the processes' parts; each part holds whole groups)."""
    counts = loader.group_counts(host)
    if counts and jax.process_count() > 1:
        keys = sorted(counts)
        total = multihost_utils.process_allgather(np.asarray([counts[k] for k in keys])).sum(0)
        counts = dict(zip(keys, map(float, total)))
    return counts


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)
