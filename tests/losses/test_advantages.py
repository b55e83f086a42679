"""Advantages and dataset composition (SPEC §2–3; 000 eq. 12; 001 eq. 2; 002 eq. 34)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses.advantages import (
    baseline_for_fraction,
    check_group_sizes,
    constant_baseline_advantages,
    dr_grpo_advantages,
    effective_positive_fraction,
    group_sizes,
    grpo_advantages,
    rloo_advantages,
)

# Ragged, unsorted groups with arbitrary ids: group 40 = {0, 3, 5}, group 7 = {1, 4},
# group 900 = {2, 6, 7, 8}.
GROUPS = np.array([40, 7, 900, 40, 7, 40, 900, 900, 900], np.int32)
REWARDS = np.array([1.0, -1.0, 0.5, -1.0, 1.0, 1.0, 2.0, -1.0, 0.0], np.float32)


def test_constant_baseline():
    np.testing.assert_allclose(constant_baseline_advantages(jnp.array([1.0, -1.0]), 0.25),
                               [0.75, -1.25])


def test_rloo_ragged_by_hand():
    # group 40: R = (1, -1, 1): A_0 = 1 - (-1+1)/2 = 1; A_3 = -1 - (1+1)/2 = -2; A_5 = 1 - 0 = 1
    # group 7: R = (-1, 1): A_1 = -1 - 1 = -2; A_4 = 1 - (-1) = 2
    # group 900: R = (.5, 2, -1, 0): A_2 = .5 - 1/3; A_6 = 2 - (-.5/3); A_7 = -1 - 2.5/3;
    # A_8 = 0 - 1.5/3
    expected = [1.0, -2.0, 0.5 - 1 / 3, -2.0, 2.0, 1.0, 2 + 0.5 / 3, -1 - 2.5 / 3, -0.5]
    got = rloo_advantages(jnp.asarray(REWARDS), jnp.asarray(GROUPS))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    jitted = jax.jit(rloo_advantages)(jnp.asarray(REWARDS), jnp.asarray(GROUPS))
    np.testing.assert_allclose(jitted, expected, rtol=1e-6, atol=1e-6)


def test_rloo_padding_rows_do_not_enter_baseline():
    rewards = jnp.array([1.0, -1.0, 0.0, 5.0])
    groups = jnp.array([3, 3, 3, 9])
    record_mask = jnp.array([1.0, 1.0, 0.0, 0.0])  # rows 2, 3 are padding
    got = rloo_advantages(rewards, groups, record_mask)
    np.testing.assert_allclose(got, [2.0, -2.0, 0.0, 0.0])


def test_rloo_singleton_group_refused_naming_groups():
    with pytest.raises(ValueError, match=r"group_ids.*first ids: 5"):
        rloo_advantages(jnp.array([1.0, -1.0, 1.0]), jnp.array([2, 2, 5]))
    with pytest.raises(ValueError, match="group_ids"):
        check_group_sizes(np.array([1, 1, 2]))


def test_rloo_singleton_with_constant_baseline():
    got = rloo_advantages(jnp.array([1.0, -1.0, 1.0]), jnp.array([2, 2, 5]),
                          singleton_baseline=-0.5)
    np.testing.assert_allclose(got, [2.0, -2.0, 1.5])


def test_rloo_traced_singleton_is_nan_not_silent():
    got = jax.jit(rloo_advantages)(jnp.array([1.0, -1.0, 1.0]), jnp.array([2, 2, 5]))
    assert np.isnan(np.asarray(got)[2]) and np.isfinite(np.asarray(got)[:2]).all()


def test_group_sizes():
    np.testing.assert_array_equal(group_sizes(jnp.asarray(GROUPS)), [3, 2, 4, 3, 2, 3, 4, 4, 4])


def test_grpo_by_hand_population_std():
    got = np.asarray(grpo_advantages(jnp.asarray(REWARDS), jnp.asarray(GROUPS)))
    expected = np.zeros(9)
    for g in np.unique(GROUPS):
        idx = np.flatnonzero(GROUPS == g)
        r = REWARDS[idx].astype(np.float64)
        mean = sum(r) / len(r)
        std = (sum((x - mean) ** 2 for x in r) / len(r)) ** 0.5
        expected[idx] = (r - mean) / (std + 1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # a few by hand: group 7 is (-1, 1): mean 0, std 1 -> (-1, 1)
    np.testing.assert_allclose(got[[1, 4]], [-1 / (1 + 1e-6), 1 / (1 + 1e-6)], rtol=1e-6)


def test_grpo_unbiased_std_option():
    got = grpo_advantages(jnp.array([1.0, -1.0, 3.0]), jnp.array([0, 0, 0]), ddof=1)
    # mean 1, unbiased var = (0 + 4 + 4)/2 = 4 -> std 2
    np.testing.assert_allclose(got, [0.0, -2 / (2 + 1e-6), 2 / (2 + 1e-6)], rtol=1e-6)


def test_dr_grpo_centres_only():
    got = dr_grpo_advantages(jnp.asarray(REWARDS), jnp.asarray(GROUPS))
    # group 900: mean (0.5 + 2 - 1 + 0)/4 = 0.375
    np.testing.assert_allclose(np.asarray(got)[[2, 6, 7, 8]],
                               [0.125, 1.625, -1.375, -0.375], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got)[[1, 4]], [-1.0, 1.0])


def test_grpo_singleton_and_padding():
    got = grpo_advantages(jnp.array([3.0, 1.0, -1.0, 7.0]), jnp.array([1, 2, 2, 2]),
                          jnp.array([1.0, 1.0, 1.0, 0.0]))
    np.testing.assert_allclose(got, [0.0, 1 / (1 + 1e-6), -1 / (1 + 1e-6), 0.0], rtol=1e-6)


def test_shape_errors_name_arguments():
    with pytest.raises(ValueError, match="group_ids"):
        rloo_advantages(jnp.ones(3), jnp.ones(4, jnp.int32))
    with pytest.raises(ValueError, match="group_ids must be integers"):
        grpo_advantages(jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match="record_mask"):
        grpo_advantages(jnp.ones(3), jnp.zeros(3, jnp.int32), jnp.ones(2))


def test_eq12_known_points():
    for p in (0.1, 0.3, 0.5, 0.9):
        np.testing.assert_allclose(effective_positive_fraction(p, 0.0), p, rtol=1e-6)
        np.testing.assert_allclose(effective_positive_fraction(p, -1.0), 1.0, rtol=1e-6)
        np.testing.assert_allclose(effective_positive_fraction(p, 1.0), 0.0, atol=1e-7)
    # the first form of eq. 12, p(1-c) / (p(1-c) + (1-p)(1+c)), at p = 0.2, c = -0.5
    p, c = 0.2, -0.5
    np.testing.assert_allclose(effective_positive_fraction(p, c),
                               p * (1 - c) / (p * (1 - c) + (1 - p) * (1 + c)), rtol=1e-6)


def test_eq12_round_trip():
    p = np.linspace(0.05, 0.95, 7)[:, None]
    target = np.linspace(0.05, 0.95, 9)[None, :]
    c = baseline_for_fraction(p, target)
    np.testing.assert_allclose(effective_positive_fraction(p, c), np.broadcast_to(target, c.shape),
                               rtol=1e-5, atol=1e-6)
    c_grid = np.linspace(-0.9, 0.9, 5)
    np.testing.assert_allclose(baseline_for_fraction(0.3, effective_positive_fraction(0.3, c_grid)),
                               c_grid, rtol=1e-4, atol=1e-5)
    # target 1 is reached by c = -1 (positives only)
    np.testing.assert_allclose(baseline_for_fraction(0.25, 1.0), -1.0, rtol=1e-6)
