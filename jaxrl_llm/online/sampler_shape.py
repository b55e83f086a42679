"""The online sampler's prompt batch, fixed once per run.

Left to itself, the sampler picks its prompt batch at every call from the memory free at
that moment (`sampling.build.fit_sampler_batch`), and with the batch every compiled shape:
a log-prob's last bits then depend on how much memory the process happens to hold, and with
`online.mu_source: sampler` they reach the update. So the online loop decides the batch once,
at the start of a run, from the config and the memory check (the longest prompt of the pool;
a pipeline's sampler also keeps room for the weight versions it holds in flight), records it
in the checkpoint, and reuses it on resume: `Policy.sampler_batch`.
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.sampling.build import fit_sampler_batch, weight_version_bytes
from jaxrl_llm.sampling.layout import from_model
from jaxrl_llm.sampling.sampler import default_bucket

# Weight versions a sampler on its own devices holds besides the one it decodes with: the
# newest published one not yet taken, and the next while its copy is being made.
IN_FLIGHT_VERSIONS = 2


def fixed_sampler_batch(config: Any, policy: Any, problems: list[Any], *,
                        in_flight: int = 0) -> int:
    """The prompt batch the sampler of `policy` uses for every round of the run: the
    largest ≤ `generate.batch_size` that fits the longest prompt of `problems` beside
    `in_flight` extra weight versions (refused, naming the keys, when one prompt does not)."""
    g = config.generate
    if g.backend != "jax":
        return g.batch_size  # vLLM manages its own memory
    model = policy.model
    longest = max((len(ids) for ids in policy.encode([policy.task.prompt(p)
                                                      for p in problems])), default=1)
    layout = from_model(model, data=g.decode_data, tensor=g.decode_tensor) \
        if g.batching == "continuous" else None
    return fit_sampler_batch(
        model, batch_size=g.batch_size, n=g.n, prompt_len=default_bucket(longest),
        max_new_tokens=g.max_new_tokens, key="generate.batch_size", layout=layout,
        say=policy.say_once, reserve=in_flight * weight_version_bytes(model, layout),
        reserved=f"{in_flight} weight versions in flight" if in_flight else "")
