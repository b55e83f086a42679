"""What a record manifest says about the sampler's per-token log-probs (manifest flags).

Written by both generation backends, read by the score pass and the trainer's preflight
checks; it lives with the manifest so neither of those imports the generation code.
"""

from __future__ import annotations

from typing import Any


def effective_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at: greedy (0) scores as 1, like the trainer."""
    return float(temperature) if temperature > 0 else 1.0


def sampler_logprob_info(*, backend: str, temperature: float, top_k: int, top_p: float,
                         logprobs_mode: str | None = None) -> dict[str, Any]:
    """Manifest `extra` flags saying what the sampler's per-token log-probs are.

    - `sampling_truncated`: top-k/top-p were on, so `behavior_logprobs` (the processed
      log-probs) are those of the truncated, renormalised distribution, not the policy's;
      `loss.mu_source: sampler` refuses such records.
    - `raw_logprobs_temperature`: the temperature of `raw_logprobs` — the JAX sampler's are
      `log_softmax(logits / T)` (T = 1 when greedy); vLLM's `raw_logprobs` mode reports them
      before any processing, temperature included (T = 1); None when there are none.
    """
    if backend == "vllm":
        raw_t = 1.0 if logprobs_mode == "raw_logprobs" else None
    else:
        raw_t = effective_temperature(temperature)
    return {"sampling_truncated": bool(top_k > 0 or top_p < 1.0), "raw_logprobs_temperature": raw_t}


def manifest_sampler_info(manifest: Any) -> dict[str, Any]:
    """`sampler_logprob_info` of a record manifest: its own flags, or (manifests written before
    the flags existed) derived from its sampling parameters and backend."""
    s = manifest.sampling
    derived = sampler_logprob_info(backend=s.backend, temperature=s.temperature, top_k=s.top_k,
                                   top_p=s.top_p, logprobs_mode=manifest.extra.get("vllm_logprobs_mode"))
    return {k: manifest.extra.get(k, v) for k, v in derived.items()}
