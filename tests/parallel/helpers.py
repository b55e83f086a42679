"""Shared fixtures for the sharding tests: a deterministic batch, configs, naive losses."""

from __future__ import annotations

import socket

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.config import config_from_dict
from jaxrl_llm.data.batch import Batch

B, T, V = 8, 12, 64
PROMPT = 4


def free_port() -> int:
    """A free localhost port for a test job's coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(seed: int = 0, batch: int = B) -> Batch:
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, V, (batch, T)).astype(np.int32)
    mask = np.zeros((batch, T), np.float32)
    lengths = rng.integers(3, T - PROMPT + 1, batch)
    for i, n in enumerate(lengths):
        mask[i, PROMPT - 1 : PROMPT - 1 + n] = 1.0
    rewards = np.where(rng.random(batch) < 0.5, 1.0, -1.0).astype(np.float32)
    mu = (rng.normal(size=(batch, T)) * 0.3 - 4.2).astype(np.float32) * mask
    return Batch(
        inputs=inputs,
        targets=np.roll(inputs, -1, axis=1),
        positions=np.tile(np.arange(T, dtype=np.int32), (batch, 1)),
        segment_ids=np.ones((batch, T), np.int32),
        loss_mask=mask,
        behavior_logprobs=mu,
        mu_logprobs=mu,
        ref_logprobs=np.zeros((batch, T), np.float32),
        rewards=rewards,
        correct=rewards > 0,
        group_ids=(np.arange(batch) // 4).astype(np.int32),
        record_mask=np.ones(batch, np.float32),
        pair_index=np.zeros((0, 2), np.int32),
    )


def make_config(loss: str, mesh: tuple[int, int, int] = (1, 1, 1), **sections):
    tree = {
        "loss": {"name": loss, "logprob_chunk_size": 24, "fpa_lambda": 1.5},
        # SGD with lr 1 and no clipping: the update is exactly −gradient.
        "optim": {"name": "sgd", "learning_rate": 1.0, "clip_norm": None},
        "mesh": dict(zip(("data", "fsdp", "tensor"), mesh)),
        "train": {"batch_size": B},
    }
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return config_from_dict(tree)


def naive_token_logprobs(hidden, unembed, targets):
    logits = jnp.einsum("btd,dv->btv", hidden, unembed)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]


def naive_topr_loss(logp, batch: Batch):
    """SPEC §2 canonical TOPR (a⁺=b⁺=1, a⁻=0, b⁻=1) in the taper form whose value is the
    eq. 11 objective: L = −A · ρ(r, a, b) / |y|, mean over records."""
    m = batch.loss_mask
    ell = jnp.sum((logp - batch.mu_logprobs) * m, -1)
    r = jnp.exp(ell)
    # ρ(x, a, b) = a(1 + log(x/a)) below a, b(1 + log(x/b)) above b, x between.
    rho_pos = 1.0 + ell  # a = b = 1
    rho_neg = jnp.where(r > 1.0, 1.0 + ell, r)  # a = 0, b = 1
    rho = jnp.where(batch.rewards >= 0, rho_pos, rho_neg)
    return jnp.mean(-batch.rewards * rho / jnp.sum(m, -1))


def naive_fpa_loss(logp, logp_hat, batch: Batch):
    """SPEC §3 FPA (002 eq. 3): L = −R · sg(exp(mean logπ̂)) · mean logπ, mean over records."""
    m = batch.loss_mask
    n = jnp.sum(m, -1)
    w = jax.lax.stop_gradient(jnp.exp(jnp.sum(logp_hat * m, -1) / n))
    return jnp.mean(-batch.rewards * w * jnp.sum(logp * m, -1) / n)


def to_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
