"""Paired statistics against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from dynamics.analysis.measures.paired_statistics import (
    DIFFERENCE,
    RATIO,
    VALUE,
    paired_statistic,
    sign_test,
)


def test_sign_test_exact_p_values():
    # 5 of 5 positive: 2 · (1/2)^5 = 1/16.
    assert sign_test([0.1, 0.2, 0.3, 0.4, 0.5]) == (pytest.approx(1 / 16), 5)
    # 4 of 5: 2 · (1 + 5) / 32 = 12/32.
    assert sign_test([-0.1, 0.2, 0.3, 0.4, 0.5]) == (pytest.approx(12 / 32), 4)
    # A tie with the null is dropped: 3 of 3 → 2/8.
    assert sign_test([0.0, 1.0, 2.0, 3.0]) == (pytest.approx(0.25), 3)
    # Against 1 (ratios): 2 below, 1 above of 3 → 2 · (1 + 3)/8 = 1.
    assert sign_test([0.5, 0.9, 1.1], null=1.0) == (1.0, 2)


def test_few_seeds_give_the_range_with_its_exact_confidence():
    stat = paired_statistic("gap", DIFFERENCE, [0, 2, 3, 4], [-0.3, -0.1, -0.2, 0.05])
    assert stat.centre == pytest.approx(-0.1375)
    assert (stat.low, stat.high) == (-0.3, 0.05)
    assert stat.confidence == pytest.approx(1 - 2**-3)  # 87.5 % for 4 seeds
    assert "range of 4 seeds" in stat.method
    assert stat.p_value == pytest.approx(2 * (1 + 4) / 16)
    assert stat.agree == 3


def test_bootstrap_interval_contains_the_known_mean_difference():
    rng = np.random.default_rng(7)
    differences = 0.5 + rng.normal(0, 0.2, size=20)
    stat = paired_statistic("gap", DIFFERENCE, range(20), differences)
    assert "BCa bootstrap of the mean over 20 seeds" in stat.method
    assert stat.low < 0.5 < stat.high
    assert stat.low < differences.mean() < stat.high
    # About ±1.96 σ/√n wide around the mean.
    assert stat.high - stat.low == pytest.approx(2 * 1.96 * 0.2 / np.sqrt(20), rel=0.35)
    again = paired_statistic("gap", DIFFERENCE, range(20), differences)
    assert (again.low, again.high) == (stat.low, stat.high)  # fixed seed: reproducible


def test_ratios_use_the_geometric_mean_and_the_null_of_one():
    stat = paired_statistic("λ1", RATIO, [0, 1], [0.1, 0.4])
    assert stat.centre == pytest.approx(0.2)
    assert stat.p_value == pytest.approx(0.5) and stat.agree == 2


def test_values_have_no_sign_test_and_one_seed_no_interval():
    stat = paired_statistic("crossover", VALUE, [3], [180.0], missing=["seed 4: no crossover"])
    assert stat.p_value is None and stat.low is None and stat.agree == 1
    assert stat.method == "1 seed: no interval"
    assert stat.to_dict()["missing"] == ["seed 4: no crossover"]
