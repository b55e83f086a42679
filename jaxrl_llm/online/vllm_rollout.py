"""A rollout worker that samples with vLLM (`generate.backend: vllm` with `jaxrl-llm online
--role worker`, docs/online.md § Pipeline): the worker's JAX policy still receives each
published version and re-scores μ with the trainer's numerics; its `rollout` exports the
version once to a local Hugging Face directory and reloads it into one running vLLM engine in
place (`generate.vllm.VllmEngine.reload`), then samples there with per-prompt seeds.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.data.records import Record
from jaxrl_llm.envs.sampled import begin_episodes, episode_records
from jaxrl_llm.generate.completions import build_records
from jaxrl_llm.generate.vllm import VllmEngine, engine_settings, needed_model_len, prompt_seeds
from jaxrl_llm.generate.vllm_env import require_vllm
from jaxrl_llm.generate.vllm_episodes import run_episodes
from jaxrl_llm.online.run_state import untruncated


def check_vllm_worker(config: Any) -> None:
    """Refuse sampling settings whose vLLM log-probs are not the sampling distribution's."""
    g = config.generate
    if not untruncated(config) or g.vllm_logprobs_mode != "processed_logprobs":
        raise ConfigError(
            "a vLLM rollout worker needs untruncated sampling (generate.top_k=0, top_p=1, "
            "temperature>0) and generate.vllm_logprobs_mode=processed_logprobs: its "
            "log-probs then are the sampling distribution's, what the online loop compares "
            f"with μ (got top_k={g.top_k}, top_p={g.top_p}, temperature={g.temperature}, "
            f"vllm_logprobs_mode={g.vllm_logprobs_mode}); or use generate.backend=jax")


class VllmRollout:
    """A worker side's sampler (`SamplerSide.sampler`): `Policy.rollout`'s interface on vLLM,
    with the weights last set on the JAX `policy`'s `state` (which still re-scores μ)."""

    def __init__(self, policy: Any, problems: Sequence[Any]) -> None:
        self._policy = policy
        g = policy.config.generate
        check_vllm_worker(policy.config)
        self.install = require_vllm()
        # the engine's length fits every prompt of the pool, so no later round outgrows it
        self._runner = policy.episode_runner()  # multi-turn episodes (env:), or None
        every = (begin_episodes(self._runner, problems, 1)[1] if self._runner is not None
                 else policy.encode([policy.task.prompt(p) for p in problems]))
        self._model_len = needed_model_len(every, g.max_new_tokens, g.vllm_max_model_len)
        self._dir = Path(tempfile.mkdtemp(prefix="jaxrl-online-vllm-"))
        self._engine: VllmEngine | None = None
        self._exported: Any = None  # the params object last loaded into the engine

    @property
    def engine_name(self) -> str:
        return str(self.install)

    def _load(self) -> VllmEngine:
        """The engine holding the current weights: exported once per version (a new params
        object), then started (first) or reloaded in place."""
        params = self._policy.state.params
        if self._engine is None or self._exported is not params:
            model = self._policy.export(str(self._dir / "policy"), overwrite=True)
            if self._engine is None:
                self._engine = VllmEngine(engine_settings(
                    self._policy.config, model, max_model_len=self._model_len,
                    on_cpu=self.install.on_cpu))
            else:
                self._engine.reload(model)
            self._exported = params
        return self._engine

    def rollout(self, problems: Sequence[Any], *, n: int | None = None, seed: int = 0,
                group_offset: int = 0) -> list[Record]:
        """`Policy.rollout` on vLLM: prompt i's seed derives from (seed, group_offset + i)."""
        g, task = self._policy.config.generate, self._policy.task
        engine = self._load()
        seeds = prompt_seeds(seed, [group_offset + i for i in range(len(problems))])
        if self._runner is not None:  # each sample an episode (generate/vllm_episodes.py)
            episodes = begin_episodes(self._runner, problems, n or g.n)[0]
            run_episodes(engine, self._runner, episodes, seeds, n=n or g.n,
                         temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                         max_new_tokens=g.max_new_tokens)
            records = episode_records(self._runner, episodes, n=n or g.n,
                                      group_offset=group_offset)
            return [r.replace(raw_logprobs=r.behavior_logprobs) for r in records]
        texts = [task.prompt(p) for p in problems]
        ids = self._policy.encode(texts)
        completions = engine.sample(ids, seeds, n=n or g.n, temperature=g.temperature, top_p=g.top_p,
                                    top_k=g.top_k, max_new_tokens=g.max_new_tokens,
                                    stop_at_eos=g.stop_at_eos)
        records = build_records(task, list(problems), ids, completions, self._policy.tokenizer,
                                group_offset=group_offset, prompts=texts)
        # untruncated (checked above): the processed log-probs are the JAX sampler's raw ones
        return [r.replace(raw_logprobs=r.behavior_logprobs) for r in records]

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        shutil.rmtree(self._dir, ignore_errors=True)
