"""`losses.common.wmean`, the one weighted mean of every kernel's metrics: an entry
of weight 0 (a masked token, a padding row or pair) never reaches the result, even NaN/inf
(NaN·0 = NaN in IEEE, so a plain Σ w·x / Σ w would let it through); no weight at all gives 0
(the trainer averages metrics over a logging window, where one NaN step would null the row).
Expected values are worked out by hand in the comments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses.common import wmean
from jaxrl_llm.losses.preference_inputs import _pair_metrics

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("x, w, expected", [
    ([1.0, 2.0, NAN, INF], [1.0, 3.0, 0.0, 0.0], 1.75),  # (1·1 + 2·3) / (1 + 3) = 7/4
    ([-INF, 5.0], [0.0, 2.0], 5.0),                      # 5·2 / 2
    ([2.0, 4.0, NAN], [0.25, 0.75, 0.0], 3.5),          # 0.5 + 3 over a total weight of 1
    ([3.0], [1.0], 3.0),
])
def test_zero_weight_entries_never_reach_the_mean(x, w, expected) -> None:
    got = wmean(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    assert float(got) == pytest.approx(expected, rel=1e-6)
    jitted = jax.jit(wmean)(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    assert float(jitted) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("x", [[1.0, 2.0], [NAN, INF], []])
def test_no_weight_gives_zero_not_nan(x) -> None:
    got = wmean(jnp.asarray(x, jnp.float32), jnp.zeros(len(x), jnp.float32))
    assert float(got) == 0.0


def test_per_token_weights_broadcast_over_a_batch() -> None:
    # [B, T] values and token weights: row 1 is padding (weight 0) holding NaN.
    x = jnp.asarray([[1.0, 3.0], [NAN, NAN]])
    w = jnp.asarray([[1.0, 1.0], [0.0, 0.0]])
    assert float(wmean(x, w)) == 2.0


def test_preference_pair_metrics_ignore_a_zero_weight_pair() -> None:
    # Pair 0: log-ratios 2 (chosen) and −2 (rejected); pair 1 has weight 0 and holds NaN.
    # β = 0.1: rewards 0.2 and −0.2, margin 0.4, accuracy 1 (Δ = 4 > 0), one pair.
    m = _pair_metrics(0.1, jnp.asarray([2.0, NAN]), jnp.asarray([-2.0, NAN]),
                      jnp.asarray([1.0, 0.0]))
    got = {k: float(v) for k, v in m.items()}
    expected = {"chosen_logratio": 2.0, "rejected_logratio": -2.0, "chosen_reward": 0.2,
                "rejected_reward": -0.2, "reward_margin": 0.4, "reward_accuracy": 1.0,
                "num_pairs": 1.0}
    assert got.keys() == expected.keys()
    np.testing.assert_allclose([got[k] for k in expected], list(expected.values()), rtol=1e-6)
