"""The public Python API: a policy you can load, sample from, score, train, evaluate, save
and export from a script (docs/api.md).

    policy = load_policy(config="my.yaml")          # or load_policy("org/name", config=...)
    records = policy.rollout(problems, n=8, seed=0)  # sample + the task's reward
    policy.step(records)                            # one optimizer update (the train step)

One `Policy` holds one `TrainState` on the configured mesh. The sampler reads the state's
current weights at every call (no export, reload or re-jit between updates); `step` runs the
same jitted, sharded `train_step` as `jaxrl-llm train` (`train.trainer.cached_train_step`);
`score` computes μ with the train step's own `forward` and log-prob kernel. Batches have one
fixed shape (`train.batch_size` rows of `train.max_seq_len` tokens), so each program compiles
once. `jaxrl-llm online` (jaxrl_llm/online/) is built on this module.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxrl_llm.config import ConfigError, ExperimentConfig, config_from_dict, load_config
from jaxrl_llm.core.paths import as_path
from jaxrl_llm.data.collate import collate, record_row
from jaxrl_llm.data.curation import apply_transform
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.signal import SignalWatch
from jaxrl_llm.envs.episodes import EpisodeRunner
from jaxrl_llm.envs.registry import env_from_config, runner_from_config
from jaxrl_llm.envs.sampled import runner_for, sample_episodes
from jaxrl_llm.eval.during_training import eval_task
from jaxrl_llm.eval.evaluate import evaluate_model
from jaxrl_llm.generate.completions import Completion, build_records, encode_prompts, format_prompts
from jaxrl_llm.losses.logprobs import token_logprobs
from jaxrl_llm.parallel.context import restore_order
from jaxrl_llm.parallel.distributed import (
    batch_on_mesh,
    global_batch,
    global_batch_from_whole,
    host_array,
)
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.policy.export import atomic_save
from jaxrl_llm.policy.opener import OpenedModel, open_model
from jaxrl_llm.sampling.build import build_sampler
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.sampler import SamplingParams
from jaxrl_llm.sampling.schedule import version_runs
from jaxrl_llm.tasks import task_from_config
from jaxrl_llm.train.checkpoint import (
    CHECKPOINT_DIR,
    Checkpointer,
    abstract_like,
    locate,
    warn_if_rounded,
)
from jaxrl_llm.train.forward import forward
from jaxrl_llm.train.loss_fn import temperature as loss_temperature
from jaxrl_llm.train.state import cast_to_dtypes, create_train_state
from jaxrl_llm.train.state_items import state_items, with_items
from jaxrl_llm.train.trainer import cached_train_step, fetch_metrics

__all__ = ["Policy", "Samples", "load_policy", "restore_state", "transform_rewards"]


@dataclass(frozen=True)
class Samples:
    """What `Policy.sample` returns: one entry per (prompt, sample), prompt-major."""

    prompt_index: np.ndarray  # [N] which prompt each completion continues
    prompt_ids: list[np.ndarray]  # per prompt: its token ids
    token_ids: list[np.ndarray]  # per completion: its token ids (stop token included)
    logprobs: list[np.ndarray]  # per completion: the sampler's log-probs (after top-k/top-p)
    raw_logprobs: list[np.ndarray]  # per completion: untruncated, at the sampling temperature
    finish_reason: list[str]
    # per completion: the weight version of each token (in-flight updates only, else None)
    versions: list[np.ndarray] | None = None
    # per completion: 1 = sampled by the model, 0 = an environment's token (episodes only)
    action_mask: list[np.ndarray] | None = None
    # per completion: [C-1, L, k] experts (model.routing_replay: sampler; data/routing.py)
    routing: list[np.ndarray] | None = None


def _as_config(config: ExperimentConfig | Mapping[str, Any] | str | None,
               overrides: Sequence[str]) -> ExperimentConfig:
    if isinstance(config, ExperimentConfig):
        return config if not overrides else config_from_dict(
            config.model_dump(mode="json"), overrides, schema=type(config))
    if isinstance(config, Mapping):
        return config_from_dict(config, overrides, source="load_policy(config=...)")
    return load_config(config, overrides)


def load_policy(source: str | None = None, *,
                config: ExperimentConfig | Mapping[str, Any] | str | None = None,
                overrides: Sequence[str] = (), mesh: Any = None) -> Policy:
    """A `Policy` from `source` (`opener.open_model`: None = the config's `model:`, an HF
    directory, a Hub id, a `.gguf`, `smollm2`, a run / checkpoint directory) with the
    experiment `config` (a YAML path, a dict, an `ExperimentConfig`, or None for the
    defaults) and `overrides` (`a.b=c`). `mesh` defaults to the config's `mesh:` section."""
    cfg = _as_config(config, overrides)
    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    opened: OpenedModel = open_model(source, cfg, mesh=mesh)
    resume = opened.kind == "checkpoint" and config is None
    if resume:
        cfg = opened.config
    state = create_train_state(cfg, mesh, model=opened.model)
    if resume:  # the run's own config: its optimizer state, step and RNG come back too
        state = restore_state(state, str(source), step=opened.info.get("step"))
    return Policy(cfg, state, opened.tokenizer, mesh, info=opened.info)


def restore_state(template: Any, path: str, *, step: int | None = None) -> Any:
    """`template` (a `TrainState`) with the arrays of checkpoint `path` (run, checkpoints or
    step directory; `step` default: its latest), restored onto the template's shardings."""
    directory, found = locate(path)
    items = state_items(template)
    target = abstract_like(items, {k: jax.tree.map(lambda x: x.sharding, v)
                                   for k, v in items.items()})
    with Checkpointer(directory, async_save=False) as ckpt:
        restored = ckpt.restore(target, step=step if step is not None else found)
    warn_if_rounded(restored.meta, f"resuming {path}")
    return with_items(template, restored.state)


def transform_rewards(records: Sequence[Record], kind: str, *, k: int | None = None
                      ) -> list[Record]:
    """Group transforms of the rewards (`rloo`, `grpo`, `dr_grpo`, `pkpo` with `k`; groups
    are `group_id`s): new records with `reward` transformed and `raw_reward` kept."""
    return apply_transform(list(records), kind, k=k)


class Policy:
    """A policy and its optimizer on a mesh (module docstring). Attributes: `config`,
    `state` (the `TrainState`), `tokenizer`, `mesh`, `task` (the config's `data.task`),
    `sampler_batch` (None: each `sample` call picks its prompt batch from `generate.batch_size`
    and the memory left; an int: that batch always, so the compiled shapes, and with them a
    log-prob's last bits, never depend on the memory free at the time: the online loop fixes
    it once per run, `online.sampler_shape`), `record_routing` (a mixture of experts: `sample`
    records each token's experts; default: `model.routing_replay: sampler`, which replays
    them; True alone records them, e.g. to measure router disagreement)."""

    def __init__(self, config: ExperimentConfig, state: Any, tokenizer: Any, mesh: Any,
                 *, info: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.state = state
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.info = dict(info or {})
        self.task = task_from_config(config)
        self._runner: EpisodeRunner | None = None  # the config's environment (episode_runner)
        self._said: set[str] = set()  # memory notes already printed (one per figure)
        self._score_fns: dict[float, Any] = {}
        self.sampler_batch: int | None = None
        self.record_routing = config.model.routing_replay == "sampler"
        self._signal = SignalWatch(config)  # `step`'s learning-signal metrics and warning

    # -- the model ------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The policy as an NNX module over the state's current weights (shared, not copied)."""
        return self.state.model()

    @property
    def updates(self) -> int:
        """Optimizer updates applied so far."""
        return int(np.asarray(self.state.step))

    # -- sampling -------------------------------------------------------------------------
    def say_once(self, text: str) -> None:
        """Print a sampling memory note once, not at every round of an online run."""
        if text not in self._said:
            self._said.add(text)
            print(text, file=sys.stderr)

    def episode_runner(self, env: Any = None) -> EpisodeRunner | None:
        """The runner of `env` (an Environment or EpisodeRunner; None: the config's `env:`,
        itself None for single-turn), built once per environment."""
        if isinstance(env, EpisodeRunner):
            return env
        if env is None:
            if self._runner is None and self.config.env.name is not None:
                self._runner = runner_from_config(self.config,
                                                  env_from_config(self.config, self.task),
                                                  self.tokenizer)
            return self._runner
        return runner_from_config(self.config, env, self.tokenizer)

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Prompt texts → token ids (chat template as `data.chat_template` says)."""
        chat = self.config.data.chat_template
        return encode_prompts(self.tokenizer, format_prompts(self.tokenizer, list(prompts),
                                                             chat_template=chat),
                              chat_template=chat)

    def sample(self, prompts: Sequence[str] | Sequence[Sequence[int]], *, n: int | None = None,
               temperature: float | None = None, max_new_tokens: int | None = None,
               seed: int = 0, weights: Callable[[], tuple[int, Any] | None] | None = None,
               version: int = 0,
               on_segment: Callable[[int, int], None] | None = None,
               turns: Any = None) -> Samples:
        """`n` completions per prompt (texts or token ids) with the KV-cache sampler
        (`sampling/sampler.py`) on the current weights; defaults from `generate:`.
        `weights`/`version`: in-flight weight updates (`ContinuousSampler.generate`); the
        samples then carry each token's version. `on_segment`: called after each decode
        segment (`Sampler.generate`); an exception it raises abandons the call. `turns`:
        multi-turn episodes (`sampling.turns.TurnHook`; `rollout(env=...)` makes one).
        With `record_routing` the samples carry each token's experts."""
        g = self.config.generate
        ids = [list(map(int, p)) for p in prompts] if prompts and not isinstance(
            prompts[0], str) else self.encode(prompts)  # type: ignore[arg-type]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        params = SamplingParams(
            max_new_tokens=max_new_tokens or g.max_new_tokens,
            temperature=g.temperature if temperature is None else temperature,
            top_k=g.top_k, top_p=g.top_p, n=n or g.n,
            stop_token_ids=(eos,) if g.stop_at_eos and eos is not None else ())
        # This update's weights, a prompt batch that fits the memory left for this call's
        # n, lengths and prompts; the compiled programs are shared (module-level jits).
        sampler = build_sampler(self.model, self.tokenizer, ids,
                                batch_size=self.sampler_batch or g.batch_size,
                                n=params.n, max_new_tokens=params.max_new_tokens,
                                key="generate.batch_size", say=self.say_once,
                                fit_memory=self.sampler_batch is None,
                                **self.config.generate.sampler_options())
        for wanted, what in ((weights, "in-flight weight updates"), (turns, "environments")):
            if wanted is not None and not isinstance(sampler, ContinuousSampler):
                raise ConfigError(f"{what} need generate.batching: continuous (it is "
                                  f"{self.config.generate.batching})")
        hook = dict(weights=weights, version=version) if weights is not None else {}
        if turns is not None:
            hook["turns"] = turns
        if self.record_routing:
            hook["return_routing"] = True
        out = sampler.generate(ids, params, jax.random.key(seed), on_segment=on_segment,
                               **hook)
        lengths = [int(x) for x in out.lengths]
        return Samples(
            prompt_index=np.asarray(out.prompt_index),
            prompt_ids=[np.asarray(p, np.int32) for p in ids],
            token_ids=[np.asarray(out.tokens[i, :m], np.int32) for i, m in enumerate(lengths)],
            logprobs=[np.asarray(out.logprobs[i, :m], np.float32) for i, m in enumerate(lengths)],
            raw_logprobs=[np.asarray(out.raw_logprobs[i, :m], np.float32)
                          for i, m in enumerate(lengths)],
            finish_reason=[str(x) for x in out.finish_reason],
            versions=None if out.versions is None else [out.versions[i, :m]
                                                        for i, m in enumerate(lengths)],
            action_mask=None if out.action_mask is None else [out.action_mask[i, :m]
                                                              for i, m in enumerate(lengths)],
            routing=None if out.routing is None else [out.routing[i, :max(m - 1, 0)].copy()
                                                      for i, m in enumerate(lengths)])

    def rollout(self, problems: Sequence[Any], *, n: int | None = None, seed: int = 0,
                group_offset: int = 0,
                weights: Callable[[], tuple[int, Any] | None] | None = None,
                version: int = 0,
                on_segment: Callable[[int, int], None] | None = None,
                env: Any = None) -> list[Record]:
        """Sample `n` completions per problem of `self.task` and reward them with the task's
        verifier: one `Record` per completion (`group_id = group_offset + problem index`).
        With in-flight `weights` (`sample`), each record's metadata `weight_versions` lists
        [version, first token] wherever the version changes. `on_segment`: as `sample`'s.
        `env`: an `envs.Environment` or `envs.EpisodeRunner` (default: the config's `env:`
        section): each completion is then a multi-turn episode (docs/environments.md), its
        record holding every token, the action mask and `metadata["episode"]`."""
        runner = self.episode_runner(env)
        if runner is not None:
            records, s = sample_episodes(
                runner, problems, n or self.config.generate.n, group_offset=group_offset,
                sample=lambda ids, turns: self.sample(ids, n=n, seed=seed, weights=weights,
                                                      version=version, on_segment=on_segment,
                                                      turns=turns))
            for record, versions in zip(records, s.versions or (), strict=s.versions is not None):
                record.metadata["weight_versions"] = version_runs(versions)
            for record, routing in zip(records, s.routing or (), strict=s.routing is not None):
                record.routing = routing
            return records
        texts = [self.task.prompt(p) for p in problems]
        ids = self.encode(texts)
        s = self.sample(ids, n=n, seed=seed, weights=weights, version=version,
                        on_segment=on_segment)
        completions = [Completion(prompt_index=int(s.prompt_index[i]), token_ids=s.token_ids[i],
                                  logprobs=s.logprobs[i], raw_logprobs=s.raw_logprobs[i],
                                  finish_reason=s.finish_reason[i],
                                  routing=None if s.routing is None else s.routing[i])
                       for i in range(len(s.token_ids))]
        records = build_records(self.task, list(problems), ids, completions, self.tokenizer,
                                group_offset=group_offset, prompts=texts)
        for record, versions in zip(records, s.versions or (), strict=s.versions is not None):
            record.metadata["weight_versions"] = version_runs(versions)
        return records

    # -- batches, scoring, training -------------------------------------------------------
    def batch(self, records: Sequence[Record], *, require_mu: bool | None = None) -> Any:
        """Records → one global `Batch` of `train.batch_size` rows × `train.max_seq_len`
        tokens (padding rows masked), sharded over the mesh's batch axes, its tokens in the
        mesh's order (`Batch.context_order`: load-balanced on a context-parallel mesh)."""
        t = self.config.train
        if len(records) > t.batch_size:
            raise ConfigError(f"{len(records)} records do not fit one batch of "
                              f"train.batch_size={t.batch_size}")
        need_mu = self.config.loss.spec.needs_mu if require_mu is None else require_mu
        replay = self.config.model.routing_replay == "sampler"  # the records' experts
        rows = [record_row(r, require_mu=need_mu, where=f"records[{i}]", routing=replay)
                for i, r in enumerate(records)]
        longest = max((r["inputs"].size for r in rows), default=0)
        if longest > t.max_seq_len:
            raise ConfigError(f"a record of {longest + 1} tokens (prompt + completion) needs "
                              f"train.max_seq_len >= {longest} (it is {t.max_seq_len})")
        whole = collate(rows, t.batch_size, (t.max_seq_len,))
        if jax.process_count() > 1:  # every process holds these records (multi-host online)
            return global_batch_from_whole(whole, self.mesh)
        return global_batch(whole, self.mesh)

    def _score_fn(self, temperature: float) -> Any:
        if temperature not in self._score_fns:
            st, mesh, chunk = self.state, self.mesh, self.config.loss.logprob_chunk_size

            def score(params: Any, model_state: Any, batch: Any) -> jax.Array:
                hidden, unembed, softcap = forward(
                    st.graphdef, cast_to_dtypes(params, st.param_dtypes), model_state,
                    batch.inputs, batch.positions, batch.segment_ids, mesh,
                    routing=batch.routing)
                return token_logprobs(hidden, unembed.astype(hidden.dtype), batch.targets,
                                      chunk_size=chunk, temperature=temperature,
                                      softcap=softcap)

            self._score_fns[temperature] = jax.jit(score)
        return self._score_fns[temperature]

    def score(self, records: Sequence[Record], *, temperature: float | None = None
              ) -> list[np.ndarray]:
        """Per-completion token log-probs under the current weights with the train step's
        numerics (its `forward` and chunked log-prob kernel) at `temperature` (default: the
        loss's, `train.loss_fn.temperature`). At most `train.batch_size` records per call.
        An episode's environment tokens are context, never actions: 0.0 there."""
        t = loss_temperature(self.config) if temperature is None else float(temperature)
        batch = self.batch(records, require_mu=False)
        logp = host_array(self._score_fn(t)(self.state.params, self.state.model_state, batch))
        logp = restore_order(logp, batch.context_order)  # back to the tokens' order
        out = []
        for i, r in enumerate(records):
            start = r.prompt_ids.size - 1
            lp = logp[i, start:start + r.completion_ids.size].astype(np.float32)
            out.append(np.where(r.model_tokens(where=f"records[{i}]"), lp, np.float32(0.0)))
        return out

    def step(self, records_or_batch: Sequence[Record] | Any) -> dict[str, float]:
        """One optimizer update on a batch (records or a `Batch`: from `batch`, or built by
        hand, e.g. with `data.collate.collate`, whole on every process) with the configured
        loss (`loss.name`, any registered loss): the same jitted, sharded `train_step` as
        `jaxrl-llm train`. A `Batch` in another token order than the mesh's
        (`Batch.context_order`: a hand-built batch is in the natural order, a context-parallel
        mesh trains on the load-balanced one) is converted first. Returns its metrics on the
        host; for records also `signal/raised` (records the loss raises) and `signal/none` (1
        when it raises none: `data.signal`), with a warning line after
        `data.signal.NO_SIGNAL_STREAK` such updates in a row unless `train.allow_no_signal`."""
        batch, signal = records_or_batch, {}
        if isinstance(records_or_batch, Sequence):
            batch = self.batch(records_or_batch)
            signal = self._signal.note(records_or_batch)  # what the loss can learn here
            if self._signal.warning and jax.process_index() == 0:
                print(self._signal.warning, file=sys.stderr)
        batch = batch_on_mesh(batch, self.mesh)
        step = cached_train_step(self.config, self.mesh, self.state)
        self.state, metrics = step(self.state, batch)  # the old state is donated
        return {**{k: float(np.asarray(v)) for k, v in fetch_metrics(metrics).items()},
                **signal}

    # -- evaluation and output ------------------------------------------------------------
    def evaluate(self, *, num_questions: int | None = None, n: int | None = None,
                 seed: int | None = None) -> dict[str, Any]:
        """pass@k, pass@1 ± SE, maj@K, invalid rate of the current weights on the `eval:`
        section's questions (`eval.evaluate.evaluate_model`): `eval.split` of the task read
        from `eval.task_path` (else `data.task_path`), the questions `jaxrl-llm evaluate`
        and `train.eval_every` grade (`eval.during_training.eval_task`), not `self.task`'s."""
        e, g = self.config.eval, self.config.generate
        task = eval_task(self.config)
        problems = task.load(split=e.split, num=num_questions or e.num_questions,
                             seed=self.config.seed)
        summary, _ = evaluate_model(
            self.model, self.tokenizer, task, problems, n=n or e.n,
            temperature=g.temperature if e.temperature is None else e.temperature,
            max_new_tokens=e.max_new_tokens or g.max_new_tokens,
            batch_size=e.batch_size or g.batch_size, seed=e.seed if seed is None else seed,
            maj_k=e.maj_k, trials=e.bootstrap_trials,
            chat_template=self.config.data.chat_template, progress=False,
            sampler=self.config.generate.sampler_options(),
            runner=runner_for(self.config, task, self.tokenizer,
                              max_new_tokens=e.max_new_tokens))
        return summary

    def save(self, directory: str | None = None, *, meta: Mapping[str, Any] | None = None) -> str:
        """An Orbax checkpoint of the whole state (params, optimizer, step, RNG) under
        `directory` (default `run_dir/checkpoints`), as `step = updates`; `export` and
        `evaluate --model` read it. Returns the step directory written (`…/checkpoints/3`)."""
        out = directory or str(as_path(self.config.run_dir) / CHECKPOINT_DIR)
        full = {"config": self.config.model_dump(
            mode="json", include=set(ExperimentConfig.model_fields)), **dict(meta or {})}
        with Checkpointer(out, async_save=False, keep=self.config.train.keep_checkpoints,
                          params_dtype=self.config.train.checkpoint_dtype) as c:
            c.save(self.updates, state_items(self.state), meta=full, force=True)
            return os.fspath(c.directory / str(self.updates))

    def export(self, out_dir: str, *, dtype: str | None = None, overwrite: bool = False) -> str:
        """The current policy as a Hugging Face directory (atomic, `export.atomic_save`;
        LoRA adapters merged)."""
        return str(atomic_save(self.model, out_dir, tokenizer=self.tokenizer, dtype=dtype,
                               overwrite=overwrite))
