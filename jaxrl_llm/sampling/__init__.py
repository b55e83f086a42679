"""How we sample: the KV-cache decode program and the batched sampler built on it."""
