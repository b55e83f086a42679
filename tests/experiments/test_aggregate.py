"""`experiments/aggregate.py`: mean ± SE over seeds, as every script's results.json keeps it.
Expected values by hand: SE = sample standard deviation (ddof 1) / √seeds, 0 for one seed."""

from __future__ import annotations

import math

import pytest

from experiments.aggregate import mean_and_se, over_seeds

# Two seeds' probe rows; "loss" is logged from step 1 on.
RUNS = [[{"step": 0, "p": 0.1}, {"step": 1, "p": 0.3, "loss": 1.0}],
        [{"step": 0, "p": 0.3}, {"step": 1, "p": 0.7, "loss": 3.0}]]


def test_curves_over_seeds() -> None:
    got = over_seeds(RUNS, "p")
    # step 0: mean 0.2, sd √((0.1² + 0.1²)/1) = 0.1√2, SE 0.1√2/√2 = 0.1; step 1: 0.5, 0.2
    assert got["mean"] == pytest.approx([0.2, 0.5])
    assert got["se"] == pytest.approx([0.1, 0.2])
    assert over_seeds(RUNS, "loss", first=1) == {"mean": [2.0], "se": [1.0]}
    assert over_seeds(RUNS, lambda r: 2 * r["p"]) == {
        "mean": pytest.approx([0.4, 1.0]), "se": pytest.approx([0.2, 0.4])}


def test_one_number_per_seed() -> None:
    # 1, 2, 6: mean 3, deviations −2, −1, 3, sd √(14/2) = √7, SE √7/√3
    got = mean_and_se([1.0, 2.0, 6.0])
    assert got == {"mean": 3.0, "se": pytest.approx(math.sqrt(7 / 3))}
    assert mean_and_se([0.25]) == {"mean": 0.25, "se": 0.0}  # one seed: no spread measured
