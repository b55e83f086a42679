"""Token log-probs, entropy, FPA log-probs and forward KL without materialising logits.

docs/kernels.md § Token log-probs: for final hidden states `H [B,T,d]` and an unembedding `W [d,V]`,

    logπ_t = z_t[y_t] − logsumexp_v z_t,v        z = H W

and (FPA, FPA arXiv:2509.19893 eq. 4) `z = (1+λ) H W − λ H_ref W_ref`. The `B×T×V` float32 logits never exist
at once, neither in the forward nor in the backward pass: the vocabulary is processed in
chunks of `chunk_size` columns with an online logsumexp, and a `jax.custom_vjp` recomputes
each logit chunk in the backward pass (one extra matmul per logit term) instead of saving it.
Peak temporary memory is O(B·T·chunk_size) instead of O(B·T·V).

`token_forward_kl_chunked` streams two models' logits through the same chunk loop
(`_scan_vocab`, `_chunk_logits` in `losses/vocab_chunks.py`) to give the exact per-token KL(π_ref ‖ π_θ) (docs/kernels.md § TOPR family, PPO, GRPO, Off-RL, FPA, KL).

`token_logprobs` and `extrapolated_logprobs` are thin callers of one kernel,
`vocab_chunks.chunked_logprobs_jit`, which evaluates logits of the general form

    z = Σ_i c_i · cap(H_i W_i)        cap(x) = s·tanh(x/s)   (identity when softcap is None)

with coefficients `c` that may be traced (temperature 1/τ, FPA's (1+λ)/τ and −λ/τ).
Gradients flow to every `H_i`, `W_i` and to the coefficients (hence to a traced temperature
or λ). Matmuls accumulate in float32 (`preferred_element_type`); bf16 inputs are accepted and
their gradients are returned in bf16.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.losses.vocab_chunks import (  # the kernels; this module checks and shapes
    RowSharding,
    chunked_forward_kl_jit,
    chunked_logprobs_jit,
)

# Chosen from benchmarks/kernels.py (SmolLM2-135M sizes, fp32, CPU): see docs/kernels.md.
DEFAULT_CHUNK_SIZE = 4096

# ----------------------------------------------------------------------- argument checks


def _check_hidden_unembed(h_name: str, hidden, w_name: str, unembed) -> None:
    hidden_shape, unembed_shape = jnp.shape(hidden), jnp.shape(unembed)
    if len(hidden_shape) != 3:
        raise ValueError(f"{h_name} must be [B, T, d]; got shape {hidden_shape}")
    if len(unembed_shape) != 2:
        raise ValueError(f"{w_name} must be [d, V]; got shape {unembed_shape}")
    if hidden_shape[-1] != unembed_shape[0]:
        raise ValueError(
            f"{h_name} has d={hidden_shape[-1]} but {w_name} has d={unembed_shape[0]} "
            f"({h_name} {hidden_shape}, {w_name} {unembed_shape})"
        )
    for name, arr in ((h_name, hidden), (w_name, unembed)):
        if not jnp.issubdtype(jnp.result_type(arr), jnp.floating):
            raise TypeError(f"{name} must be floating point; got dtype {jnp.result_type(arr)}")
    if jnp.result_type(hidden) != jnp.result_type(unembed):
        raise TypeError(
            f"{h_name} ({jnp.result_type(hidden)}) and {w_name} ({jnp.result_type(unembed)}) "
            "must have the same dtype; cast one of them explicitly"
        )


def _check_policy_and_reference(hidden, unembed, ref_hidden, ref_unembed) -> None:
    """Both models' inputs, and that they cover the same tokens and the same vocabulary."""
    _check_hidden_unembed("hidden", hidden, "unembed", unembed)
    _check_hidden_unembed("ref_hidden", ref_hidden, "ref_unembed", ref_unembed)
    if tuple(jnp.shape(ref_hidden)[:2]) != tuple(jnp.shape(hidden)[:2]):
        raise ValueError(
            f"ref_hidden [B, T] = {tuple(jnp.shape(ref_hidden)[:2])} must equal hidden's "
            f"{tuple(jnp.shape(hidden)[:2])}"
        )
    if jnp.shape(ref_unembed)[1] != jnp.shape(unembed)[1]:
        raise ValueError(
            f"ref_unembed has V={jnp.shape(ref_unembed)[1]} but unembed has "
            f"V={jnp.shape(unembed)[1]}; both models must share the vocabulary"
        )


def _check_targets(targets, hidden_shape: tuple[int, ...], vocab: int) -> None:
    if not jnp.issubdtype(jnp.result_type(targets), jnp.integer):
        raise TypeError(f"targets must be integer token ids; got dtype {jnp.result_type(targets)}")
    if tuple(jnp.shape(targets)) != tuple(hidden_shape[:2]):
        raise ValueError(
            f"targets shape {tuple(jnp.shape(targets))} must equal hidden's [B, T] = "
            f"{tuple(hidden_shape[:2])}"
        )
    if not isinstance(targets, jax.core.Tracer):
        host = np.asarray(targets)
        bad = (host < 0) | (host >= vocab)
        if bad.any():
            where = np.argwhere(bad)[0].tolist()
            raise ValueError(
                f"targets must lie in [0, V={vocab}); {int(bad.sum())} do not "
                f"(first at index {where}: {int(host[tuple(where)])})"
            )


def _check_positive(name: str, value, *, allow_zero: bool = False) -> None:
    if isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    if arr.shape != ():
        raise ValueError(f"{name} must be a scalar; got shape {arr.shape}")
    ok = (arr >= 0) if allow_zero else (arr > 0)
    if not (np.isfinite(arr) and ok):
        bound = "≥ 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}; got {value!r}")


def _check_options(chunk_size, softcap, temperature) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise TypeError(f"chunk_size must be a Python int (static); got {chunk_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0; got {chunk_size}")
    if softcap is not None:
        if isinstance(softcap, jax.core.Tracer):
            raise TypeError("softcap must be a Python float or None (static), not a traced value")
        _check_positive("softcap", softcap)
    _check_positive("temperature", temperature)


# -------------------------------------------------------------------------- public API


def token_logprobs(
    hidden: jax.Array,
    unembed: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
    temperature: float | jax.Array = 1.0,
    softcap: float | None = None,
    row_sharding: RowSharding | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Per-token log-probs `logπ_t = z_t[y_t] − logsumexp(z_t)` (docs/kernels.md § Token log-probs), chunked.

    Args:
      hidden: final hidden states `[B, T, d]` (float32 or bf16).
      unembed: unembedding `[d, V]`, same dtype as `hidden`. Pass it as the transpose of a
        `[V, d]` table (the embedding when tied, or an lm_head stored as rows, as the models
        here do): the kernel works on rows, so the two transposes cancel and no `[V, d]`
        copy is made; a `[d, V]` array given directly costs one transposed copy.
      targets: token ids `[B, T]` in `[0, V)`; position t is scored against `hidden[:, t]`
        (shift by one outside this function).
      chunk_size: vocabulary columns per chunk (static). Peak temporary memory is about
        `4 · B·T·chunk_size` float32 elements instead of the naive `≥ 2 · B·T·V`; V need not
        be a multiple of it.
      return_entropy: also return the per-token entropy `−Σ_v p_v log p_v` (with gradient).
      temperature: the sampling temperature τ (docs/architecture.md § Why μ is re-scored): `z ← z / τ`; may be traced.
      softcap: Gemma 2's final-logit soft-capping `z ← s·tanh(z / s)`, applied before τ.
      row_sharding: on a mesh, how the `[V, d]` table is split over "fsdp" and how one chunk
        of it is gathered (`vocab_chunks.RowSharding`); None lets GSPMD place it.

    Returns:
      `logp [B, T]` float32, or `(logp, entropy)` when `return_entropy`. Gradients flow to
      `hidden`, `unembed` and a traced `temperature`; the backward pass recomputes logit
      chunks (one extra matmul) instead of storing them. Out-of-range targets raise when
      `targets` is concrete and give NaN under `jit`.
    """
    _check_hidden_unembed("hidden", hidden, "unembed", unembed)
    _check_targets(targets, jnp.shape(hidden), jnp.shape(unembed)[1])
    _check_options(chunk_size, softcap, temperature)
    b, t, d = hidden.shape
    coefs = jnp.reshape(1.0 / jnp.asarray(temperature, jnp.float32), (1,))
    terms = ((hidden.reshape(b * t, d), unembed.T),)
    logp, entropy = chunked_logprobs_jit(
        terms, coefs, targets.reshape(b * t), int(chunk_size), softcap, row_sharding
    )
    chex.assert_shape((logp, entropy), (b * t,))
    logp = logp.reshape(b, t)
    return (logp, entropy.reshape(b, t)) if return_entropy else logp


def extrapolated_logprobs(
    hidden: jax.Array,
    unembed: jax.Array,
    ref_hidden: jax.Array,
    ref_unembed: jax.Array,
    targets: jax.Array,
    *,
    lam: float | jax.Array,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float | jax.Array = 1.0,
    softcap: float | None = None,
    row_sharding: RowSharding | None = None,
) -> jax.Array:
    """FPA's extrapolated log-probs `log π̂_t = z_t[y_t] − logsumexp(z_t)` (FPA eq. 4).

    `z = ((1+λ) cap(H W) − λ cap(H_ref W_ref)) / τ`: the extrapolation acts on each model's
    final logits (soft-capped per model when `softcap` is set, as the model itself would),
    then the sampling temperature. Same chunked kernel as `token_logprobs`; neither model's
    `B×T×V` logits exist at once. The reference model may have a different hidden size.

    Gradients are exact and flow to all four arrays and to a traced `lam`/`temperature`;
    FPA's loss (FPA eq. 3, docs/kernels.md § TOPR family, PPO, GRPO, Off-RL, FPA, KL) wraps the result in `stop_gradient`, in which case no
    backward pass is built at all.

    Args:
      hidden, unembed: the trained policy's final hidden states `[B,T,d]` and unembedding
        `[d,V]`.
      ref_hidden, ref_unembed: the frozen reference model's `[B,T,d_ref]` and `[d_ref,V]`.
      targets: token ids `[B, T]` in `[0, V)`.
      lam: extrapolation strength λ ≥ 0 (may be traced, e.g. a schedule value).
      chunk_size, temperature, softcap, row_sharding: as in `token_logprobs`.
    Returns:
      `logp_hat [B, T]` float32.
    """
    _check_policy_and_reference(hidden, unembed, ref_hidden, ref_unembed)
    _check_targets(targets, jnp.shape(hidden), jnp.shape(unembed)[1])
    _check_options(chunk_size, softcap, temperature)
    _check_positive("lam", lam, allow_zero=True)
    if not isinstance(lam, jax.core.Tracer) and float(lam) == 0.0:
        # π̂ = π at λ = 0: skip the reference model's matmuls (and match token_logprobs bitwise).
        return token_logprobs(hidden, unembed, targets, chunk_size=chunk_size,
                              temperature=temperature, softcap=softcap,
                              row_sharding=row_sharding)
    b, t, d = hidden.shape
    inv_tau = 1.0 / jnp.asarray(temperature, jnp.float32)
    lam = jnp.asarray(lam, jnp.float32)
    coefs = jnp.stack([(1.0 + lam) * inv_tau, -lam * inv_tau])
    terms = (
        (hidden.reshape(b * t, d), unembed.T),
        (ref_hidden.reshape(b * t, ref_hidden.shape[-1]), ref_unembed.T),
    )
    logp, _ = chunked_logprobs_jit(terms, coefs, targets.reshape(b * t), int(chunk_size), softcap,
                                   row_sharding)
    return logp.reshape(b, t)


def token_forward_kl_chunked(
    hidden: jax.Array,
    unembed: jax.Array,
    ref_hidden: jax.Array,
    ref_unembed: jax.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float | jax.Array = 1.0,
    softcap: float | None = None,
    row_sharding: RowSharding | None = None,
) -> jax.Array:
    """Exact per-token forward KL `KL(π_ref ‖ π_θ)_t = Σ_v q_t,v (log q_t,v − log p_t,v)`.

    The exact per-token form of the Forward-KL Off-RL regulariser (FPA eq. 33), fed
    to `off_rl_kl_loss(token_kl=…)`. `p = softmax(cap(H W)/τ)` is the policy and
    `q = softmax(cap(H_ref W_ref)/τ)` the reference, at the same context (position t of both
    hidden-state arrays). Both models' logits are streamed over vocabulary chunks with an
    online logsumexp (the same chunk machinery as `token_logprobs`), so neither model's
    `B×T×V` logits exist at once.

    Gradients flow to `hidden` and `unembed` only (`∂KL/∂z = p − q`, recomputed chunk by
    chunk in the backward pass); the reference arrays and `temperature` are treated as
    constants (`stop_gradient`).

    Args:
      hidden, unembed: the trained policy's `[B,T,d]` and `[d,V]` (same dtype).
      ref_hidden, ref_unembed: the reference model's `[B,T,d_ref]` and `[d_ref,V]`; the hidden
        size may differ, the vocabulary may not.
      chunk_size, temperature, softcap, row_sharding: as in `token_logprobs` (applied to
        both models).
    Returns:
      `kl [B, T]` float32, clamped at 0 against fp32 rounding.
    """
    _check_policy_and_reference(hidden, unembed, ref_hidden, ref_unembed)
    _check_options(chunk_size, softcap, temperature)
    b, t, d = hidden.shape
    inv_tau = jax.lax.stop_gradient(1.0 / jnp.asarray(temperature, jnp.float32))
    coefs = jnp.stack([inv_tau, inv_tau])
    policy = (hidden.reshape(b * t, d), unembed.T)
    ref = jax.lax.stop_gradient(
        (ref_hidden.reshape(b * t, ref_hidden.shape[-1]), ref_unembed.T)
    )
    kl = chunked_forward_kl_jit(policy, ref, coefs, int(chunk_size), softcap, row_sharding)
    chex.assert_shape(kl, (b * t,))
    return kl.reshape(b, t)
