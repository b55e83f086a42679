"""A tiny annotated NNX model for the sharding tests (used until/unless the real Decoder is
importable). It has the Decoder's interface: `__call__(tokens, *, positions, segment_ids)`
→ hidden [B,T,d], `unembedding()` → [d,V], logical axis names on every parameter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], scale: float):
    return nnx.Param(jax.random.normal(rngs.params(), shape) * scale, out_sharding=names)


class ToyLM(nnx.Module):
    def __init__(self, vocab: int = 64, d: int = 16, ff: int = 32, *, rngs: nnx.Rngs):
        self.embed = _param(rngs, (vocab, d), ("vocab", "embed"), 0.5)
        self.w_in = _param(rngs, (d, ff), ("embed", "mlp"), d**-0.5)
        self.w_out = _param(rngs, (ff, d), ("mlp", "embed"), ff**-0.5)
        self.norm = nnx.Param(jnp.ones((d,)), out_sharding=("norm",))
        self.final_logit_softcap = None

    def __call__(self, tokens, *, positions=None, segment_ids=None):
        x = jnp.take(self.embed[...], tokens, axis=0)
        # Position-dependent mixing so positions matter, and a causal running mean.
        if positions is not None:
            x = x * (1.0 + 0.01 * positions[..., None])
        x = x + jnp.tanh(x @ self.w_in[...]) @ self.w_out[...]
        t = x.shape[1]
        causal = jnp.tril(jnp.ones((t, t))) / jnp.arange(1, t + 1)[:, None]
        x = x + jnp.einsum("st,btd->bsd", causal, x)
        return x * self.norm[...] / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

    def unembedding(self):
        return self.embed[...].T
