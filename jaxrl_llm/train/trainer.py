"""The trainer: a thin loop around the one jitted `train_step` (issue 7; DESIGN "The flow").

    records (grain BatchLoader) ─▶ global sharded Batch ─▶ train_step ─▶ metrics window
          ▲                                                   │
          └── iterator position ◀── Orbax checkpoint ◀── state (params, opt, step, rng)

- Metrics: every step's scalars go into a `MetricWindow`; every `train.log_every` steps one
  row (means, sums for counts, plus throughput) goes to `metrics.jsonl` and TensorBoard.
- Checkpoints (`train/checkpoint.py`): every `train.checkpoint_every` steps (async) and at
  the end; the loop step, the grain iterator position and the resolved config are saved
  with the state, so a resumed run consumes the same records and ends with the same
  parameters as an uninterrupted one (deterministic given the seeds).
- Resume: a `Trainer` whose `run_dir/checkpoints` holds a committed checkpoint continues
  from the latest one.
- SIGTERM (preemption): the loop finishes the current step, checkpoints, and returns with
  `stopped=True` (the `train` command then exits with 143).
- Non-finite steps are skipped by the step itself; `train.max_nonfinite_steps` consecutive
  ones stop the run with an error (never train on NaN).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.config import ConfigError, ExperimentConfig, dump_config

EXIT_PREEMPTED = 143  # 128 + SIGTERM, what schedulers expect of a job stopped by SIGTERM

# (step, state) -> metrics to log under "eval/" (or None)
EvalHook = Callable[[int, Any], Mapping[str, float] | None]
# (step, host batch) -> None: sees every batch before it is trained on (tests, data audits)
BatchHook = Callable[[int, Any], None]
# (step, trainer) -> None: after each step (tests, custom schedules)
StepHook = Callable[[int, "Trainer"], None]

# Losses that never read μ (no importance ratio): records need no score pass.
MU_FREE_LOSSES = ("sft", "off_rl", "off_rl_kl", "fpa", "dpo", "rpo", "kto", "apo")

# Kernel metrics that compare π with μ: meaningless (μ = 0) when the loss reads no μ.
RATIO_METRICS = ("loss/log_ratio", "loss/ess", "loss/clip_frac")

STATE_FIELDS = ("step", "params", "opt_state", "model_state", "rng", "ref_params")


def state_items(state: Any) -> dict[str, Any]:
    """The arrays of a `TrainState` that a checkpoint holds (static fields are rebuilt)."""
    return {name: getattr(state, name) for name in STATE_FIELDS
            if getattr(state, name) is not None}


def with_items(state: Any, items: Mapping[str, Any]) -> Any:
    return state.replace(**dict(items))


def model_factory(config: ExperimentConfig) -> Callable[[], Any] | None:
    """How to build `config.model` when `train.state.build_model` cannot (GGUF sources);
    None means the default (random init or an HF directory)."""
    if config.model.source in ("gguf", "smollm2"):
        from jaxrl_llm.generate.loading import model_and_tokenizer

        return lambda: model_and_tokenizer(config)[0]
    return None


@dataclass(frozen=True)
class TrainResult:
    step: int  # loop steps completed (train steps called)
    state: Any  # final TrainState
    stopped: bool  # True when SIGTERM stopped the run early
    run_dir: Path
    checkpoint_dir: Path
    metrics_path: Path
    last_row: dict[str, Any]


class Trainer:
    """Trains `config` on the records in `records` (default `data.records`) into `run_dir`
    (default `config.run_dir`); see the module docstring."""

    def __init__(
        self,
        config: ExperimentConfig,
        *,
        records: str | Path | None = None,
        run_dir: str | Path | None = None,
        model: Any | None = None,
        mesh: Any | None = None,
        eval_hook: EvalHook | None = None,
        on_batch: BatchHook | None = None,
        on_step: StepHook | None = None,
        progress: bool = True,
        tensorboard: bool = True,
    ) -> None:
        import jax

        from jaxrl_llm.data.loader import make_loader, packing_options
        from jaxrl_llm.parallel.mesh import make_mesh
        from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR, Checkpointer

        self.config = config
        records = records if records is not None else config.data.records
        if records is None:
            raise ConfigError("data.records: the trainer needs a records directory to train on")
        self.records = str(records)
        self.run_dir = Path(run_dir if run_dir is not None else config.run_dir)
        self.mesh = mesh if mesh is not None else make_mesh(config.mesh)
        self.eval_hook, self.on_batch, self.on_step = eval_hook, on_batch, on_step
        self.progress = progress and jax.process_index() == 0
        self.tensorboard = tensorboard
        self._model = model
        self._stop = threading.Event()

        count = jax.process_count()
        if config.train.batch_size % count:
            raise ConfigError(f"train.batch_size={config.train.batch_size} must divide over the "
                              f"{count} processes")
        d = config.data
        self.uses_mu = config.loss.name not in MU_FREE_LOSSES
        self.loader = make_loader(
            self.records,
            batch_size=config.train.batch_size // count,
            max_len=config.train.max_seq_len,
            buckets=tuple(d.buckets),
            seed=d.shuffle_seed,
            num_epochs=d.num_epochs,
            too_long=d.too_long,
            read_threads=d.read_threads,
            prefetch=d.prefetch,
            require_mu=config.loss.mu_source == "trainer" and self.uses_mu,
            process_index=jax.process_index(),
            process_count=count,
            **packing_options(config),
        )
        self.checkpoint_dir = self.run_dir / CHECKPOINT_DIR
        self.checkpointer = Checkpointer(
            self.checkpoint_dir,
            save_every=config.train.checkpoint_every,
            keep=config.train.keep_checkpoints,
        )

    # -- state -----------------------------------------------------------------------------

    def _initial_state(self) -> tuple[Any, int]:
        """(state, loop step): restored from the latest checkpoint when there is one."""
        from jaxrl_llm.train.checkpoint import abstract_like
        from jaxrl_llm.train.state import abstract_train_state, create_train_state

        latest = self.checkpointer.latest_step()
        factory = model_factory(self.config)
        if self._model is None and factory is not None:
            self._model = factory()
        if latest is None:
            return create_train_state(self.config, self.mesh, self._model), 0
        if self._model is None:
            template = abstract_train_state(self.config, self.mesh)
        else:
            template = create_train_state(self.config, self.mesh, self._model)
        items = state_items(template)
        shardings = {k: _shardings(v) for k, v in items.items()}
        restored = self.checkpointer.restore(
            abstract_like(items, shardings), step=latest, data_iterator=self.loader
        )
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
        self._stop.set()

    def run(self) -> TrainResult:
        import jax
        from tqdm.auto import tqdm

        from jaxrl_llm.eval.window import MetricWindow
        from jaxrl_llm.losses.types import finite_or_raise
        from jaxrl_llm.parallel.distributed import global_batch
        from jaxrl_llm.train.metrics_log import MetricsLogger

        cfg = self.config.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            (self.run_dir / "config.yaml").write_text(dump_config(self.config))
        state, step = self._initial_state()
        train_step = cached_train_step(self.config, self.mesh, state)
        logger = MetricsLogger(self.run_dir, resume_step=step if step else None,
                               tensorboard=self.tensorboard, enabled=jax.process_index() == 0)
        previous = _install_sigterm(self._stop)
        window = MetricWindow()
        bar = tqdm(total=cfg.steps, initial=step, disable=not self.progress, desc="train",
                   unit="step", dynamic_ncols=True)
        last_row: dict[str, Any] = {}
        nonfinite = 0
        tokens, steps_in, t_window = 0, 0, time.perf_counter()
        try:
            while step < cfg.steps and not self._stop.is_set():
                try:
                    host = next(self.loader)
                except StopIteration:  # data.num_epochs exhausted before train.steps
                    break
                finite_or_raise(rewards=host.rewards, mu_logprobs=host.mu_logprobs,
                                behavior_logprobs=host.behavior_logprobs,
                                ref_logprobs=host.ref_logprobs)
                if self.on_batch is not None:
                    self.on_batch(step + 1, host)
                tokens += int(np.count_nonzero(host.segment_ids)) * jax.process_count()
                state, metrics = train_step(state, global_batch(host, self.mesh))
                step += 1
                steps_in += 1
                scalars = {k: float(v) for k, v in jax.device_get(metrics).items()
                           if self.uses_mu or not k.startswith(RATIO_METRICS)}
                nonfinite = nonfinite + 1 if scalars.get("update_skipped", 0.0) else 0
                if nonfinite >= cfg.max_nonfinite_steps:
                    raise FloatingPointError(
                        f"step {step}: {nonfinite} consecutive steps had a non-finite loss or "
                        f"gradient (loss={scalars.get('loss')}, grad_norm="
                        f"{scalars.get('grad_norm')}); stopping (train.max_nonfinite_steps)"
                    )
                window.add(scalars)
                bar.update(1)
                bar.set_postfix(loss=f"{scalars['loss']:.4g}", refresh=False)
                if cfg.eval_every and self.eval_hook and step % cfg.eval_every == 0:
                    extra = self.eval_hook(step, state) or {}
                    window.add({f"eval/{k}": v for k, v in extra.items()})
                if step % cfg.log_every == 0 or step == cfg.steps:
                    elapsed = max(time.perf_counter() - t_window, 1e-9)
                    row = window.flush()
                    row["throughput/tokens_per_s"] = tokens / elapsed
                    row["throughput/steps_per_s"] = steps_in / elapsed
                    last_row = logger.log(step, row)
                    bar.set_postfix(loss=f"{row['loss']:.4g}",
                                    tok_s=f"{row['throughput/tokens_per_s']:.0f}")
                    tokens, steps_in, t_window = 0, 0, time.perf_counter()
                self.checkpointer.save(step, state_items(state), data_iterator=self.loader,
                                       meta=self._meta(step, state))
                if self.on_step is not None:
                    self.on_step(step, self)
            stopped = self._stop.is_set() and step < cfg.steps
            if len(window):
                last_row = logger.log(step, window.flush())
            self.checkpointer.save(step, state_items(state), data_iterator=self.loader,
                                   meta=self._meta(step, state), force=True)
            self.checkpointer.wait()
        finally:
            bar.close()
            logger.close()
            _restore_sigterm(previous)
        return TrainResult(
            step=step, state=state, stopped=stopped, run_dir=self.run_dir,
            checkpoint_dir=self.checkpoint_dir, metrics_path=logger.path,
            last_row=last_row,
        )

    def close(self) -> None:
        self.checkpointer.close()


# Config keys the train step never reads: runs differing only in these share one compiled step.
_STEP_IRRELEVANT: dict[str, Any] = {
    "name": True, "run_dir": True, "data": True, "eval": True, "plan": True,
    "train": {"log_every", "checkpoint_every", "keep_checkpoints", "eval_every",
              "max_nonfinite_steps"},
}
_STEP_CACHE: dict[Any, Any] = {}
_STEP_CACHE_SIZE = 4


def cached_train_step(config: ExperimentConfig, mesh: Any, state: Any) -> Any:
    """`make_train_step`, reused across Trainers of one process (the `iterate` loop and
    resumed runs) when the step-relevant config, mesh, state structure and shardings match,
    so a new Trainer does not recompile."""
    import jax

    from jaxrl_llm.train.step import make_train_step

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


def _shardings(tree: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: x.sharding, tree)


def _install_sigterm(stop: threading.Event) -> Any:
    """Route SIGTERM to `stop` (main thread only; elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())


def _restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


# -- `jaxrl-llm train` ----------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxrl_llm.config_cli import add_config_arguments

    add_config_arguments(parser, required=True)
    parser.add_argument("--records", default=None, help="records directory (default data.records)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.config import load_config

    config = load_config(args.config, args.overrides)
    trainer = Trainer(config, records=args.records, progress=not args.no_progress)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    if result.stopped:
        print(f"stopped by SIGTERM at step {result.step}; checkpoint in {result.checkpoint_dir}")
        return EXIT_PREEMPTED
    print(f"trained {result.step} steps; checkpoints {result.checkpoint_dir}; "
          f"metrics {result.metrics_path}")
    return 0
