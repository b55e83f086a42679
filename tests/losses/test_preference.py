"""Preference losses (SPEC §4) against hand-computed values, make_pairs, and the FPA/DPO
identity of 002 App. A.3 (eq. 8) — exact for one softmax, broken by per-token normalisers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.data.pairs import make_pairs
from jaxrl_llm.losses.preference import (
    PREFERENCE_LOSSES,
    apo_loss,
    dpo_loss,
    kto_loss,
    rpo_loss,
    sft_loss,
    soft_group_values,
)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# A tiny batch with hand-chosen sequence sums. Row lengths |y| = 2, 3, 1, 2; the third token
# of row 0 is padding holding NaN (must be ignored). Row 4 is a padding record.
#   row  log π(y)   log π_ref(y)   log-ratio   correct   reward   group
#   0    −3.0       −4.0           +1.0        yes       1.0      7
#   1    −5.0       −4.0           −1.0        no       −1.0      7
#   2    −2.0       −2.5           +0.5        yes       1.0      9
#   3    −6.0       −7.0           +1.0        no        0.0      9
NAN = float("nan")
LOGP = np.array(
    [[-1.0, -2.0, NAN], [-1.0, -2.0, -2.0], [-2.0, 0.0, 0.0], [-4.0, -2.0, 0.0], [0.0, 0.0, 0.0]],
    np.float32,
)
REF = np.array(
    [[-2.5, -1.5, 0.0], [-1.0, -1.0, -2.0], [-2.5, 0.0, 0.0], [-3.0, -4.0, 0.0], [0.0, 0.0, 0.0]],
    np.float32,
)
MASK = np.array(
    [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], np.float32
)
RECORD_MASK = np.array([1, 1, 1, 1, 0], np.float32)
CORRECT = np.array([True, False, True, False, False])
REWARDS = np.array([1.0, -1.0, 1.0, 0.0, 5.0], np.float32)
GROUPS = np.array([7, 7, 9, 9, 7], np.int32)
# pairs: Δ = 1 − (−1) = 2; 0.5 − 1 = −0.5; 0.5 − (−1) = 1.5; then a padding pair and a pair
# touching the padding row 4 (both must be ignored)
PAIRS = np.array([[0, 1], [2, 3], [2, 1], [-1, -1], [0, 4]], np.int32)


def test_dpo_hand_computed():
    out = dpo_loss(LOGP, REF, MASK, PAIRS, record_mask=RECORD_MASK)
    # −log σ(βΔ) = softplus(−βΔ) with β = 0.1
    want = softplus(-0.2) + softplus(0.05) + softplus(-0.15)
    assert float(out.weight) == 3.0
    np.testing.assert_allclose(out.total, want, rtol=1e-6)
    m = out.metrics
    np.testing.assert_allclose(m["reward_accuracy"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["reward_margin"], 0.1 * (2.0 - 0.5 + 1.5) / 3, rtol=1e-6)
    np.testing.assert_allclose(m["chosen_logratio"], (1.0 + 0.5 + 0.5) / 3, rtol=1e-6)
    np.testing.assert_allclose(m["rejected_logratio"], (-1.0 + 1.0 - 1.0) / 3, rtol=1e-6)
    np.testing.assert_allclose(m["chosen_reward"], 0.1 * 2 / 3, rtol=1e-6)
    # β = 0.5: softplus(−1) + softplus(0.25) + softplus(−0.75)
    out = dpo_loss(LOGP, REF, MASK, PAIRS[:3], beta=0.5)
    np.testing.assert_allclose(out.total, softplus(-1) + softplus(0.25) + softplus(-0.75), rtol=1e-6)


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    grad = jax.grad(lambda lp: dpo_loss(lp, REF, MASK, PAIRS[:1]).loss)(jnp.asarray(LOGP))
    # d/dlogπ(y_w) of softplus(−βΔ) = −β σ(−βΔ) = −0.1 σ(−0.2) on every chosen token
    np.testing.assert_allclose(grad[0, :2], -0.1 * sigmoid(-0.2), rtol=1e-5)
    np.testing.assert_allclose(grad[1], 0.1 * sigmoid(-0.2), rtol=1e-5)
    assert np.all(grad[0, 2] == 0.0) and np.all(grad[2:] == 0.0)


def test_rpo_hand_computed():
    out = rpo_loss(LOGP, REF, MASK, PAIRS, record_mask=RECORD_MASK)
    # chosen NLL per token: row 0: 3.0 / 2 = 1.5; row 2: 2.0 / 1 = 2.0 (α = 1)
    want = softplus(-0.2) + 1.5 + softplus(0.05) + 2.0 + softplus(-0.15) + 2.0
    np.testing.assert_allclose(out.total, want, rtol=1e-6)
    assert float(out.weight) == 3.0
    np.testing.assert_allclose(out.metrics["chosen_nll_per_token"], (1.5 + 2.0 + 2.0) / 3, rtol=1e-6)
    out = rpo_loss(LOGP, REF, MASK, PAIRS[:1], alpha=0.5)
    np.testing.assert_allclose(out.total, softplus(-0.2) + 0.5 * 1.5, rtol=1e-6)


def test_kto_hand_computed():
    out = kto_loss(LOGP, REF, MASK, CORRECT, record_mask=RECORD_MASK)
    # log-ratios 1, −1, 0.5, 1 → z0 = max(0, 1.5 / 4) = 0.375; β = 0.1, λ_w = λ_l = 1
    v = [sigmoid(0.1 * (1 - 0.375)), sigmoid(0.1 * (0.375 + 1)),
         sigmoid(0.1 * (0.5 - 0.375)), sigmoid(0.1 * (0.375 - 1))]
    np.testing.assert_allclose(out.total, 4 - sum(v), rtol=1e-6)
    assert float(out.weight) == 4.0
    np.testing.assert_allclose(out.metrics["z0"], 0.375, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["chosen_logratio"], 0.75, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["rejected_logratio"], 0.0, atol=1e-7)
    # negative mean log-ratio: z0 clamps to 0; λ_w = 2, λ_l = 0.5 (rows 1 and 2 only)
    rm = np.array([0, 1, 1, 0, 0], np.float32)
    flipped = kto_loss(-LOGP + 2 * REF, REF, MASK, CORRECT, record_mask=rm,
                       lambda_w=2.0, lambda_l=0.5)
    # log-ratios become −lr: row 1 → +1 (incorrect), row 2 → −0.5 (correct); mean 0.25 → z0 0.25
    want = (0.5 - 0.5 * sigmoid(0.1 * (0.25 - 1.0))) + (2.0 - 2.0 * sigmoid(0.1 * (-0.5 - 0.25)))
    np.testing.assert_allclose(flipped.total, want, rtol=1e-6)
    neg = kto_loss(LOGP, REF, MASK, CORRECT, record_mask=np.array([0, 1, 0, 0, 0], np.float32))
    np.testing.assert_allclose(neg.metrics["z0"], 0.0)  # mean −1 → max(0, −1) = 0
    np.testing.assert_allclose(neg.total, 1 - sigmoid(0.1 * (0 + 1)), rtol=1e-6)
    given = kto_loss(LOGP, REF, MASK, CORRECT, record_mask=rm, z0=jnp.float32(0.0))
    np.testing.assert_allclose(given.metrics["z0"], 0.0)


def test_apo_hand_computed():
    # V̂ = β₁ log mean exp(R/β₁), β₁ = 0.5: group 7 rewards {1, −1}, group 9 {1, 0}
    v7 = 0.5 * math.log((math.exp(2.0) + math.exp(-2.0)) / 2)
    v9 = 0.5 * math.log((math.exp(2.0) + math.exp(0.0)) / 2)
    values = soft_group_values(REWARDS, GROUPS, record_mask=RECORD_MASK)
    np.testing.assert_allclose(values[:4], [v7, v7, v9, v9], rtol=1e-6)
    out = apo_loss(LOGP, REF, MASK, REWARDS, GROUPS, record_mask=RECORD_MASK)
    lr, r, v = [1.0, -1.0, 0.5, 1.0], [1.0, -1.0, 1.0, 0.0], [v7, v7, v9, v9]
    want = sum((1e-3 * lr[i] - (r[i] - v[i])) ** 2 for i in range(4))
    np.testing.assert_allclose(out.total, want, rtol=1e-6)
    assert float(out.weight) == 4.0
    # given values and β₂ = 1
    given = apo_loss(LOGP, REF, MASK, REWARDS, GROUPS, record_mask=RECORD_MASK, beta2=1.0,
                     values=np.zeros(5, np.float32))
    np.testing.assert_allclose(given.total, (1 - 1) ** 2 + (-1 + 1) ** 2 + (0.5 - 1) ** 2 + 1.0)
    # large rewards at tiny β₁ do not overflow: V̂ → max of the group
    big = soft_group_values(np.array([300.0, 100.0], np.float32), np.array([3, 3]), beta1=0.01)
    np.testing.assert_allclose(big, 300.0 + 0.01 * math.log(0.5), rtol=1e-6)


def test_sft_hand_computed():
    out = sft_loss(LOGP, MASK, record_mask=RECORD_MASK)
    np.testing.assert_allclose(out.total, 3 + 5 + 2 + 6)
    norm = sft_loss(LOGP, MASK, record_mask=RECORD_MASK, length_norm=True)
    np.testing.assert_allclose(norm.total, 3 / 2 + 5 / 3 + 2 / 1 + 6 / 2, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["nll_per_token"], 16 / 8)


def test_registry_passes_the_fields_each_loss_needs():
    fields = dict(pair_index=PAIRS, rewards=REWARDS, correct=CORRECT, group_ids=GROUPS,
                  record_mask=RECORD_MASK)
    direct = {
        "dpo": dpo_loss(LOGP, REF, MASK, PAIRS, record_mask=RECORD_MASK, beta=0.2),
        "rpo": rpo_loss(LOGP, REF, MASK, PAIRS, record_mask=RECORD_MASK, beta=0.2),
        "kto": kto_loss(LOGP, REF, MASK, CORRECT, record_mask=RECORD_MASK, beta=0.2),
    }
    for name, want in direct.items():
        got = PREFERENCE_LOSSES[name](LOGP, REF, MASK, beta=0.2, **fields)
        np.testing.assert_allclose(got.total, want.total, rtol=1e-6)
    got = PREFERENCE_LOSSES["apo"](LOGP, REF, MASK, **fields)
    np.testing.assert_allclose(
        got.total, apo_loss(LOGP, REF, MASK, REWARDS, GROUPS, record_mask=RECORD_MASK).total
    )
    # SFT on positives only by default: rows 0 and 2
    np.testing.assert_allclose(PREFERENCE_LOSSES["sft"](LOGP, REF, MASK, **fields).total, 3 + 2)
    all_rows = PREFERENCE_LOSSES["sft"](LOGP, REF, MASK, positives_only=False, **fields)
    np.testing.assert_allclose(all_rows.total, 16)
    assert set(PREFERENCE_LOSSES) == {"dpo", "rpo", "kto", "apo", "sft"}


def test_losses_are_jittable_and_padding_nan_is_ignored():
    jitted = jax.jit(dpo_loss)(LOGP, REF, MASK, PAIRS, record_mask=RECORD_MASK)
    eager = dpo_loss(LOGP, REF, MASK, PAIRS, record_mask=RECORD_MASK)
    np.testing.assert_allclose(jitted.total, eager.total, rtol=1e-6)
    assert np.isfinite(float(eager.total))
    out = jax.jit(apo_loss)(LOGP, REF, MASK, REWARDS, GROUPS, record_mask=RECORD_MASK)
    assert np.isfinite(float(out.total))
    empty = dpo_loss(LOGP, REF, MASK, np.zeros((0, 2), np.int32))
    assert float(empty.weight) == 0.0 and float(empty.loss) == 0.0


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match=r"dpo_loss: pair_index\[1\] = \[2, 5\] points past"):
        dpo_loss(LOGP, REF, MASK, np.array([[0, 1], [2, 5]], np.int32))
    with pytest.raises(ValueError, match=r"pairs row 2 with itself"):
        dpo_loss(LOGP, REF, MASK, np.array([[2, 2]], np.int32))
    with pytest.raises(ValueError, match=r"kto_loss: correct must have shape \[5\]"):
        kto_loss(LOGP, REF, MASK, CORRECT[:3])
    with pytest.raises(ValueError, match=r"rpo_loss: ref_logp must have the shape of mask"):
        rpo_loss(LOGP, REF[:, :2], MASK, PAIRS)
    with pytest.raises(ValueError, match=r"pair_index must have shape \[P, 2\]"):
        dpo_loss(LOGP, REF, MASK, np.array([0, 1], np.int32))


# ---------------------------------------------------------------- make_pairs


def test_make_pairs_counts_cap_and_membership():
    # group 5: 2 correct × 3 incorrect = 6 pairs; group 8: 4 × 5 = 20 → capped at 16;
    # group 2: all correct → no pair; row 14 (correct, group 5) is padding
    groups = np.array([5, 8, 5, 8, 8, 5, 8, 8, 8, 8, 8, 5, 2, 5, 5, 8], np.int32)
    correct = np.array([1, 1, 0, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 1, 0], bool)
    record_mask = np.ones(16)
    record_mask[14] = 0
    pairs = make_pairs(groups, correct, seed=3, record_mask=record_mask)
    assert pairs.dtype == np.int32 and pairs.shape == (6 + 16, 2)
    assert np.all(correct[pairs[:, 0]]) and not np.any(correct[pairs[:, 1]])
    assert np.all(groups[pairs[:, 0]] == groups[pairs[:, 1]])
    assert 14 not in pairs
    assert len({tuple(p) for p in pairs}) == len(pairs)
    g5 = pairs[groups[pairs[:, 0]] == 5]
    assert {tuple(p) for p in g5} == {(c, i) for c in (0, 5) for i in (2, 11, 13)}
    assert list(groups[pairs[:, 0]]) == [5] * 6 + [8] * 16  # groups in order of first row
    np.testing.assert_array_equal(pairs, make_pairs(groups, correct, seed=3, record_mask=record_mask))
    other = make_pairs(groups, correct, seed=4, record_mask=record_mask)
    assert not np.array_equal(pairs[6:], other[6:]) and np.array_equal(pairs[:6], other[:6])
    # a prompt's sample does not depend on the other prompts in the batch
    only8 = make_pairs(groups, correct, seed=3, record_mask=record_mask * (groups == 8))
    np.testing.assert_array_equal(only8, pairs[6:])
    capped = make_pairs(groups, correct, seed=3, record_mask=record_mask, max_pairs_per_prompt=2)
    assert capped.shape == (4, 2)


def test_make_pairs_padding_and_errors():
    groups, correct = np.array([1, 1, 2]), np.array([True, False, True])
    padded = make_pairs(groups, correct, pad_to=4)
    np.testing.assert_array_equal(padded, [[0, 1], [-1, -1], [-1, -1], [-1, -1]])
    assert make_pairs(np.array([1, 1]), np.array([True, True])).shape == (0, 2)
    with pytest.raises(ValueError, match=r"1 pairs do not fit pad_to=0"):
        make_pairs(groups, correct, pad_to=0)
    with pytest.raises(ValueError, match=r"correct must have the shape of group_ids"):
        make_pairs(groups, correct[:2])
    with pytest.raises(ValueError, match=r"max_pairs_per_prompt must be ≥ 1"):
        make_pairs(groups, correct, max_pairs_per_prompt=0)
    # padded pairs feed straight into the pairwise losses
    out = dpo_loss(LOGP[:3], REF[:3], MASK[:3], padded)
    np.testing.assert_allclose(out.total, softplus(-0.2), rtol=1e-6)


# ---------------------------------------------------------------- FPA ↔ DPO (002 eq. 8)

LAMBDA, BETA, VOCAB = 1.5, 0.1, 7


def _logits(seed: int, shape) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape) * 2.0


def _extrapolated_logprobs(h, h_ref, tokens):
    """log π̂ = log softmax((1+λ) h − λ h_ref) gathered at the tokens (002 eq. 4)."""
    z = jax.nn.log_softmax((1 + LAMBDA) * h - LAMBDA * h_ref, axis=-1)
    return jnp.take_along_axis(z, tokens[..., None], -1)[..., 0]


def _gather(h, tokens):
    return jnp.take_along_axis(jax.nn.log_softmax(h, -1), tokens[..., None], -1)[..., 0]


def test_fpa_dpo_identity_contextual_bandit():
    """y_w, y_l single tokens after one prompt: DPO(π̂, β) = DPO(π, β(1+λ))."""
    tokens = jnp.array([[2], [5]])  # row 0 = y_w, row 1 = y_l
    h_ref = jnp.broadcast_to(_logits(1, (VOCAB,)), (2, 1, VOCAB))  # same prompt: same logits
    mask, pair = jnp.ones((2, 1)), jnp.array([[0, 1]], jnp.int32)
    ref_logp = _gather(h_ref, tokens)

    def via_fpa(h_prompt):  # one logit vector for the prompt, shared by both completions
        h = jnp.broadcast_to(h_prompt, (2, 1, VOCAB))
        return dpo_loss(_extrapolated_logprobs(h, h_ref, tokens), ref_logp, mask, pair, beta=BETA).loss

    def via_beta(h_prompt):
        h = jnp.broadcast_to(h_prompt, (2, 1, VOCAB))
        return dpo_loss(_gather(h, tokens), ref_logp, mask, pair, beta=BETA * (1 + LAMBDA)).loss

    h = _logits(0, (VOCAB,))
    np.testing.assert_allclose(via_fpa(h), via_beta(h), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(via_fpa)(h), jax.grad(via_beta)(h), rtol=1e-5, atol=1e-7)


def test_fpa_dpo_identity_fails_with_per_token_normalisers():
    """Two-token completions: the second tokens follow different prefixes (y_w,1 ≠ y_l,1), so
    each has its own softmax and log Ẑ_t ≠ (1+λ) log Z_t − λ log Z_ref,t: no identity."""
    tokens = jnp.array([[2, 4], [5, 1]])
    h = _logits(0, (2, 2, VOCAB)).at[1, 0].set(_logits(0, (2, 2, VOCAB))[0, 0])  # same prompt
    h_ref = _logits(1, (2, 2, VOCAB)).at[1, 0].set(_logits(1, (2, 2, VOCAB))[0, 0])
    mask, pair = jnp.ones((2, 2)), jnp.array([[0, 1]], jnp.int32)
    ref_logp = _gather(h_ref, tokens)
    fpa = dpo_loss(_extrapolated_logprobs(h, h_ref, tokens), ref_logp, mask, pair, beta=BETA)
    scaled = dpo_loss(_gather(h, tokens), ref_logp, mask, pair, beta=BETA * (1 + LAMBDA))
    assert abs(float(fpa.loss) - float(scaled.loss)) > 1e-3, (fpa.loss, scaled.loss)
    # the first (shared-context) tokens alone still satisfy the identity
    first = dpo_loss(_extrapolated_logprobs(h, h_ref, tokens)[:, :1], ref_logp[:, :1],
                     mask[:, :1], pair, beta=BETA)
    first_scaled = dpo_loss(_gather(h, tokens)[:, :1], ref_logp[:, :1], mask[:, :1], pair,
                            beta=BETA * (1 + LAMBDA))
    np.testing.assert_allclose(first.loss, first_scaled.loss, rtol=1e-6)
