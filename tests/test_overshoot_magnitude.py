"""The overshoot magnitudes (peak / plateau, peak / start, isotonic residual area) on scripted
curves whose values follow in closed form, and through ``dynamics overshoot``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.optimize import brentq

from dynamics.analysis.measures.overshoot import detect_overshoot
from dynamics.store import RunWriter, SeriesSpec

STEPS = np.arange(5000)
# Flat 1, rise to 2, flat top, fall to 1.5, flat plateau: smoothing leaves every flat part and
# every straight piece as it is, so the peak, start and plateau are exact.
KNOTS = ([0, 500, 1500, 2000, 3000, 4999], [1.0, 1.0, 2.0, 2.0, 1.5, 1.5])


def curve(t: np.ndarray) -> np.ndarray:
    return np.interp(t, *KNOTS)


def closed_form_area() -> float:
    """The best monotone fit of the curve is increasing: the curve up to the level m, then m,
    where m is the curve's mean after it first reaches m. The area is ∫ |curve − m| there."""
    fine = np.linspace(0, 4999, 2_000_001)

    def after(m: float) -> np.ndarray:
        return fine[fine >= 500 + (m - 1.0) * 1000]

    def excess(m: float) -> float:
        t = after(m)
        return float(np.trapezoid(curve(t), t) / (t[-1] - t[0])) - m

    level = brentq(excess, 1.01, 1.99)
    t = after(level)
    return float(np.trapezoid(np.abs(curve(t) - level), t))


def test_magnitudes_of_a_scripted_overshoot():
    (layer,) = detect_overshoot(STEPS, curve(STEPS)).layers
    assert layer.verdict == "overshoot"
    assert layer.peak_value == pytest.approx(2.0)
    assert layer.start_value == pytest.approx(1.0)
    assert layer.plateau_value == pytest.approx(1.5)
    assert layer.peak_over_plateau == pytest.approx(2.0 / 1.5)
    assert layer.peak_over_start == pytest.approx(2.0)
    # Smoothing rounds the corners by 100 records; the area it moves is a fraction of a percent.
    assert layer.residual_area == pytest.approx(closed_form_area(), rel=0.01)


def test_area_scales_with_the_hump_and_is_zero_when_monotone():
    (half,) = detect_overshoot(STEPS, 1 + 0.5 * (curve(STEPS) - 1)).layers
    (full,) = detect_overshoot(STEPS, curve(STEPS)).layers
    assert half.residual_area == pytest.approx(0.5 * full.residual_area, rel=1e-9)
    (rise,) = detect_overshoot(STEPS, np.interp(STEPS, [0, 500, 2000, 4999], [1, 1, 2, 2])).layers
    assert rise.verdict == "no_overshoot"
    assert rise.residual_area == pytest.approx(0.0, abs=1e-9)
    assert rise.peak_over_start == pytest.approx(2.0)


def test_area_is_in_steps_not_records():
    (every,) = detect_overshoot(STEPS, curve(STEPS)).layers
    (tenth,) = detect_overshoot(STEPS * 10, curve(STEPS)).layers
    assert tenth.residual_area == pytest.approx(10 * every.residual_area, rel=1e-9)


def test_dynamics_overshoot_prints_the_magnitudes(dynamics, tmp_path):
    path = tmp_path / "run.h5"
    series = {"hidden_norms": {"norm": SeriesSpec((1,), columns=("block0",))}}
    writer = RunWriter.create(path, series, {}, {})
    for t, value in zip(STEPS[::5], curve(STEPS[::5])):
        writer.append("hidden_norms", int(t), {"norm": np.array([value])})
    writer.close()
    (expected,) = detect_overshoot(STEPS[::5], curve(STEPS[::5])).layers
    result = dynamics("overshoot", path, "--json")
    assert result.returncode == 0, result.stderr
    (layer,) = json.loads(result.stdout)["layers"]
    assert layer["residual_area"] == pytest.approx(expected.residual_area)
    assert layer["peak_over_plateau"] == pytest.approx(2.0 / 1.5)
    table = dynamics("overshoot", path)
    assert "residual area" in table.stdout.splitlines()[1]
    assert f"{expected.residual_area:.4g}" in table.stdout
