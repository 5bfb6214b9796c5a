"""The overshoot detector on series whose answer is known by construction."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynamics.analysis.measures.overshoot import OvershootReport, detect_overshoot

N = 400


def overshoot_curve(u: np.ndarray, *, peak_at: float = 0.3, fall: float = 0.3) -> np.ndarray:
    """Rises from 1 to 2 (flat at the top) by ``u = peak_at``, then settles ``fall`` lower."""
    rise = 1.0 + np.sin(np.pi / 2 * np.minimum(u / peak_at, 1.0)) ** 2
    return rise - fall * (1.0 - np.exp(-np.maximum(u - peak_at, 0.0) / 0.08))


def saturating_rise(u: np.ndarray) -> np.ndarray:
    return 1.0 + (1.0 - np.exp(-u / 0.15))


def unit(n: int = N) -> np.ndarray:
    return np.linspace(0.0, 1.0, n)


def only(report: OvershootReport):
    (layer,) = report.layers
    return layer


def verdicts(report: OvershootReport) -> list[str]:
    return [layer.verdict for layer in report.layers]


# --- shapes without noise ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(lambda u: 1 + 3 * u, id="linear-rise"),
        pytest.param(saturating_rise, id="saturating-rise"),
        pytest.param(lambda u: 1 + 1 / (1 + np.exp(-(u - 0.4) / 0.05)), id="sigmoid-rise"),
    ],
)
def test_monotone_rise_is_not_an_overshoot(shape):
    layer = only(detect_overshoot(np.arange(N), shape(unit())))
    assert layer.verdict == "no_overshoot"
    assert not layer.overshoot
    assert layer.nonmonotonicity == pytest.approx(0.0, abs=1e-12)


def test_monotone_fall_peaks_at_its_first_record():
    layer = only(detect_overshoot(np.arange(N), 3.0 - saturating_rise(unit())))
    assert layer.verdict == "no_overshoot"
    assert layer.peak_step == 0
    assert "first record" in layer.reason
    assert layer.nonmonotonicity == pytest.approx(0.0, abs=1e-12)  # a decreasing fit is exact


def test_rise_to_a_plateau_is_not_an_overshoot():
    u = unit()
    layer = only(detect_overshoot(np.arange(N), 1 + np.minimum(u / 0.3, 1.0)))
    assert layer.verdict == "no_overshoot"
    assert layer.nonmonotonicity == pytest.approx(0.0, abs=1e-12)


def test_a_dip_is_not_an_overshoot():
    u = unit()
    layer = only(detect_overshoot(np.arange(N), 2.0 - (overshoot_curve(u) - 1.0)))
    assert layer.verdict == "no_overshoot"
    assert layer.nonmonotonicity > 0.05  # non-monotone, but falls first: the wrong way round


def test_clear_overshoot_reports_peak_and_magnitudes():
    steps = np.arange(N) * 10
    layer = only(detect_overshoot(steps, overshoot_curve(unit(), peak_at=0.3, fall=0.3)))
    assert layer.verdict == "overshoot"
    assert layer.overshoot
    assert layer.signature is None  # no loss given
    assert layer.peak_in_window is None
    true_peak_step = 0.3 * (N - 1) * 10
    assert abs(layer.peak_step - true_peak_step) <= 0.03 * steps[-1]
    assert layer.peak_value == pytest.approx(2.0, abs=0.02)  # smoothing rounds the top
    assert layer.start_value == pytest.approx(1.0, abs=0.01)
    assert layer.plateau_value == pytest.approx(1.7, abs=0.01)
    assert layer.peak_over_plateau == pytest.approx(2.0 / 1.7, rel=0.02)
    assert layer.peak_over_start == pytest.approx(2.0, rel=0.02)
    assert layer.nonmonotonicity > 0.05
    assert layer.smoothing_half_width == 8  # round(0.02 * 400)


def test_small_sag_on_a_rise_is_below_the_thresholds():
    layer = only(detect_overshoot(np.arange(N), overshoot_curve(unit(), fall=0.03)))
    assert layer.verdict == "no_overshoot"
    assert "min_nonmonotonicity" in layer.reason


def test_a_fall_at_the_very_end_has_no_plateau_to_settle_on():
    layer = only(detect_overshoot(np.arange(N), overshoot_curve(unit(), peak_at=0.9, fall=0.5)))
    assert layer.verdict == "no_overshoot"
    assert "final tail" in layer.reason


def test_a_fall_of_under_one_percent_of_the_norm_is_ignored():
    x = 100.0 + overshoot_curve(unit(), fall=0.5)  # falls 0.5 from a peak of 102: 0.5%
    assert "min_relative_drop" in only(detect_overshoot(np.arange(N), x)).reason
    assert only(detect_overshoot(np.arange(N), x, min_relative_drop=0.001)).overshoot


def test_score_and_verdict_are_scale_invariant():
    x = overshoot_curve(unit())
    small, large = (
        only(detect_overshoot(np.arange(N), x)),
        only(detect_overshoot(np.arange(N), 1e3 * x)),
    )
    assert large.verdict == small.verdict == "overshoot"
    assert large.nonmonotonicity == pytest.approx(small.nonmonotonicity, rel=1e-9)
    assert large.peak_over_plateau == pytest.approx(small.peak_over_plateau, rel=1e-9)


# --- noise ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [0.01, 0.05, 0.2])
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(saturating_rise, id="rise"),
        pytest.param(lambda u: 3 - saturating_rise(u), id="fall"),
    ],
)
def test_noisy_monotone_series_do_not_overshoot(shape, sigma):
    rng = np.random.default_rng(0)
    clean = shape(unit())[:, None]
    noisy = clean + sigma * rng.standard_normal((N, 20))  # 20 seeded draws as 20 "layers"
    assert verdicts(detect_overshoot(np.arange(N), noisy)) == ["no_overshoot"] * 20


@pytest.mark.parametrize("sigma", [0.1, 1.0, 10.0])
@pytest.mark.parametrize("n", [20, 200, 2000])
def test_pure_noise_does_not_overshoot(n, sigma):
    rng = np.random.default_rng(1)
    noise = 50.0 + sigma * rng.standard_normal((n, 20))
    assert not detect_overshoot(np.arange(n), noise).any_overshoot


def test_heavy_tailed_pure_noise_does_not_overshoot():
    rng = np.random.default_rng(2)
    noise = 50.0 + rng.standard_t(2, size=(500, 20))
    assert not detect_overshoot(np.arange(500), noise).any_overshoot


def test_autocorrelated_pure_noise_does_not_overshoot():
    rng = np.random.default_rng(3)
    white = rng.standard_normal((600, 20))
    wander = np.empty_like(white)
    wander[0] = white[0]
    for i in range(1, len(white)):  # AR(1), coefficient 0.5
        wander[i] = 0.5 * wander[i - 1] + white[i]
    assert not detect_overshoot(np.arange(600), 50.0 + wander).any_overshoot


@pytest.mark.parametrize(
    ("sigma", "n"),
    [(0.01, 100), (0.05, 200), (0.1, 1000), (0.2, 4000)],
    ids=["snr30", "snr6", "snr3-long", "snr1.5-longer"],
)
def test_overshoot_buried_in_noise_is_found_when_snr_allows(sigma, n):
    rng = np.random.default_rng(4)
    noisy = overshoot_curve(unit(n), fall=0.3)[:, None] + sigma * rng.standard_normal((n, 10))
    report = detect_overshoot(np.arange(n), noisy)
    assert verdicts(report) == ["overshoot"] * 10
    for layer in report.layers:
        assert abs(layer.peak_step - 0.3 * (n - 1)) <= 0.1 * n


def test_overshoot_drowned_in_noise_is_not_claimed():
    rng = np.random.default_rng(5)
    n = 100
    noisy = overshoot_curve(unit(n), fall=0.3)[:, None] + 1.0 * rng.standard_normal((n, 10))
    report = detect_overshoot(np.arange(n), noisy)
    assert not report.any_overshoot
    assert all(layer.snr < 5 for layer in report.layers)  # rejected for the noise, not shape


def test_min_snr_is_configurable():
    rng = np.random.default_rng(6)
    x = overshoot_curve(unit(200)) + 0.05 * rng.standard_normal(200)
    default = only(detect_overshoot(np.arange(200), x))
    strict = only(detect_overshoot(np.arange(200), x, min_snr=default.snr * 1.01))
    assert default.verdict == "overshoot"
    assert strict.verdict == "no_overshoot"
    assert "min_snr" in strict.reason
    assert detect_overshoot(np.arange(200), x, min_snr=7.5).thresholds.min_snr == 7.5


# --- degenerate series ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 9])
def test_very_short_series_get_a_too_short_verdict(n):
    layer = only(detect_overshoot(np.arange(n), np.linspace(1.0, 2.0, n)))
    assert layer.verdict == "too_short"
    assert not layer.overshoot
    assert layer.peak_step is None
    assert layer.n_points == n
    assert "at least 10" in layer.reason


def test_min_points_is_configurable():
    x = overshoot_curve(unit(30))
    assert only(detect_overshoot(np.arange(30), x)).verdict == "overshoot"
    assert only(detect_overshoot(np.arange(30), x, min_points=31)).verdict == "too_short"


def test_constant_series():
    layer = only(detect_overshoot(np.arange(50), np.full(50, 3.5)))
    assert layer.verdict == "constant"
    assert not layer.overshoot
    assert layer.nonmonotonicity is None


def test_nan_segments_are_ignored_and_counted():
    x = overshoot_curve(unit())
    x[50:80] = np.nan  # during the rise
    x[200:240] = np.nan  # during the fall
    x[300] = np.inf
    layer = only(detect_overshoot(np.arange(N), x))
    assert layer.verdict == "overshoot"
    assert layer.n_nonfinite == 71
    assert layer.n_points == N - 71
    assert abs(layer.peak_step - 0.3 * (N - 1)) <= 0.03 * N


def test_all_nan_layer_is_too_short():
    layer = only(detect_overshoot(np.arange(20), np.full(20, np.nan)))
    assert layer.verdict == "too_short"
    assert layer.n_nonfinite == 20


# --- uneven steps and several layers -------------------------------------------------------


def test_uneven_steps_report_the_peak_in_steps():
    # Log-spaced recording, as a schedule dense early would do; the overshoot peaks at step 1,000.
    steps = np.unique(np.geomspace(1, 100_000, 300).astype(int))
    x = overshoot_curve(np.log10(steps) / 5.0, peak_at=0.6)
    layer = only(detect_overshoot(steps, x))
    assert layer.verdict == "overshoot"
    assert isinstance(layer.peak_step, int)
    assert 700 <= layer.peak_step <= 1500


def test_several_layers_with_names():
    u = unit()
    norms = np.stack([overshoot_curve(u), saturating_rise(u), 1 + np.minimum(u / 0.3, 1)], axis=1)
    report = detect_overshoot(np.arange(N), norms, layer_names=["blocks.0", "blocks.1", "blocks.2"])
    assert verdicts(report) == ["overshoot", "no_overshoot", "no_overshoot"]
    assert report.layer("blocks.0").overshoot
    assert report.any_overshoot
    with pytest.raises(KeyError):
        report.layer("blocks.9")
    default = detect_overshoot(np.arange(N), norms)
    assert [layer.name for layer in default.layers] == ["layer_0", "layer_1", "layer_2"]


def test_one_column_matches_a_one_dimensional_series():
    x = overshoot_curve(unit())
    assert detect_overshoot(np.arange(N), x) == detect_overshoot(np.arange(N), x[:, None])


# --- the loss window -----------------------------------------------------------------------


def sigmoid_loss(steps: np.ndarray, centre: float, width: float) -> np.ndarray:
    """log-loss falls by 3 nats around ``centre``: steepest there, flat far from it."""
    return np.exp(-3.0 / (1.0 + np.exp(-(steps - centre) / width)))


@pytest.mark.parametrize(("peak_at", "inside"), [(0.3, True), (0.7, False)])
def test_peak_inside_or_outside_the_fastest_descent(peak_at, inside):
    steps = np.arange(1000)
    norms = overshoot_curve(steps / 999, peak_at=peak_at)
    rng = np.random.default_rng(7)
    loss = sigmoid_loss(steps, 300, 40) * np.exp(0.05 * rng.standard_normal(1000))
    report = detect_overshoot(steps, norms, loss_steps=steps, loss=loss)
    window = report.loss_window
    assert window.found and window.scale == "log"
    # log-loss slope of a sigmoid halves at centre +- 1.76 width
    assert abs(window.steepest_step - 300) <= 15
    assert 200 <= window.start_step <= 250 and 350 <= window.end_step <= 400
    layer = only(report)
    assert layer.overshoot
    assert layer.peak_in_window is inside
    assert layer.signature is inside


def test_loss_window_slope_is_per_step_not_per_record():
    # Records 0-100 one step apart: log-loss falls 1 nat over 100 steps (0.01 per step).
    # Then one record every 10 steps: 2 nats over 1,000 steps (0.002 per step, but 0.02 per
    # record). Per step, the first segment is the fastest descent.
    fast = np.arange(0, 100)
    slow = np.arange(100, 1101, 10)
    steps = np.concatenate([fast, slow])
    log_loss = np.concatenate([-0.01 * fast, -1.0 - 0.002 * (slow - 100)])
    window = detect_overshoot(
        steps, np.ones(len(steps)), loss_steps=steps, loss=np.exp(log_loss)
    ).loss_window
    assert window.found
    assert window.steepest_step < 100
    assert window.end_step <= 110


def test_loss_with_non_positive_values_uses_a_linear_scale():
    steps = np.arange(200)
    loss = 1.0 - 1.0 / (1.0 + np.exp(-(steps - 80) / 10.0))  # reaches 0.0 in float
    loss[-1] = -1e-3
    window = detect_overshoot(steps, np.ones(200), loss_steps=steps, loss=loss).loss_window
    assert window.scale == "linear"
    assert abs(window.steepest_step - 80) <= 5


def test_loss_that_never_falls_has_no_window():
    steps = np.arange(100)
    report = detect_overshoot(
        steps, overshoot_curve(unit(100)), loss_steps=steps, loss=1.0 + steps / 100
    )
    assert not report.loss_window.found
    assert "never decreases" in report.loss_window.reason
    layer = only(report)
    assert layer.overshoot and layer.peak_in_window is False and layer.signature is False


def test_loss_with_nans_and_too_few_values():
    steps = np.arange(30)
    loss = np.exp(-steps / 10.0)
    loss[5:25] = np.nan  # leaves exactly 10 finite values
    window = detect_overshoot(steps, np.ones(30), loss_steps=steps, loss=loss).loss_window
    assert window.found
    assert window.n_nonfinite == 20 and window.n_points == 10
    window = detect_overshoot(
        steps, np.ones(30), loss_steps=steps, loss=loss, min_points=11
    ).loss_window
    assert not window.found
    assert window.start_step is None
    assert "only 10 finite loss values; at least 11" in window.reason


# --- results -------------------------------------------------------------------------------


def test_to_dict_is_json_ready():
    steps = np.arange(N, dtype=np.int64)
    norms = np.stack([overshoot_curve(unit()), np.full(N, np.nan)], axis=1)
    report = detect_overshoot(steps, norms, loss_steps=steps, loss=sigmoid_loss(steps, 120, 20))
    data = report.to_dict()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert data["any_overshoot"] is True
    assert [layer["verdict"] for layer in data["layers"]] == ["overshoot", "too_short"]
    assert type(data["layers"][0]["peak_step"]) is int
    assert type(data["loss_window"]["start_step"]) is int
    assert data["thresholds"]["min_snr"] == 5.0


def test_float_steps_give_float_peak_steps():
    layer = only(detect_overshoot(np.linspace(0.0, 3.0, N), overshoot_curve(unit())))
    assert type(layer.peak_step) is float
    assert layer.peak_step == pytest.approx(0.9, abs=0.1)


def test_results_are_frozen():
    report = detect_overshoot(np.arange(N), overshoot_curve(unit()))
    with pytest.raises(AttributeError):
        report.layers[0].overshoot = False


def test_inputs_are_not_mutated():
    steps = np.arange(N)
    norms = overshoot_curve(unit())[:, None].repeat(2, axis=1)
    norms[10:20, 0] = np.nan
    loss = sigmoid_loss(steps, 100, 20)
    copies = [a.copy() for a in (steps, norms, loss)]
    for a in (steps, norms, loss):
        a.flags.writeable = False  # any write would raise
    detect_overshoot(steps, norms, loss_steps=steps, loss=loss, layer_names=("a", "b"))
    for original, copy in zip((steps, norms, loss), copies):
        np.testing.assert_array_equal(original, copy)


def test_plain_lists_are_accepted():
    report = detect_overshoot(list(range(N)), overshoot_curve(unit()).tolist())
    assert only(report).verdict == "overshoot"


# --- validation at the boundary ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": np.arange(5), "norms": np.ones(6)}, "norms has 6 rows but steps has 5"),
        ({"steps": [0, 1, 1, 2], "norms": np.ones(4)}, r"strictly increasing: steps\[2\]=1"),
        ({"steps": [0, 2, 1], "norms": np.ones(3)}, "strictly increasing"),
        ({"steps": [0.0, np.nan, 2.0], "norms": np.ones(3)}, "steps must be finite"),
        ({"steps": np.zeros((2, 2)), "norms": np.ones(2)}, "steps must be one-dimensional"),
        ({"steps": ["a", "b"], "norms": np.ones(2)}, "steps must be numeric"),
        ({"steps": np.arange(3), "norms": np.ones((3, 2, 2))}, r"shape \(n,\) or \(n, L\)"),
        ({"steps": np.arange(3), "norms": ["x", "y", "z"]}, "norms must be numeric"),
        (
            {"steps": np.arange(3), "norms": np.ones(3), "loss": np.ones(3)},
            "loss_steps and loss must be given together",
        ),
        (
            {"steps": np.arange(3), "norms": np.ones(3), "loss_steps": [0, 1], "loss": [1.0]},
            r"loss must have shape \(2,\)",
        ),
        (
            {"steps": np.arange(3), "norms": np.ones(3), "loss_steps": [1, 0], "loss": [1, 1]},
            "loss_steps must be strictly increasing",
        ),
        (
            {"steps": np.arange(3), "norms": np.ones((3, 2)), "layer_names": ["a"]},
            "layer_names has 1 names for 2 norm columns",
        ),
        (
            {"steps": np.arange(3), "norms": np.ones((3, 2)), "layer_names": ["a", "a"]},
            "layer_names must be unique",
        ),
        ({"steps": np.arange(3), "norms": np.ones(3), "smooth_fraction": 0.5}, "smooth_fraction"),
        ({"steps": np.arange(3), "norms": np.ones(3), "tail_fraction": 0.0}, "tail_fraction"),
        ({"steps": np.arange(3), "norms": np.ones(3), "min_points": 2}, "min_points"),
        ({"steps": np.arange(3), "norms": np.ones(3), "min_points": 10.5}, "min_points"),
        ({"steps": np.arange(3), "norms": np.ones(3), "min_snr": -1.0}, "min_snr"),
        ({"steps": np.arange(3), "norms": np.ones(3), "window_fraction": 1.5}, "window_fraction"),
    ],
)
def test_bad_input_raises_one_clear_value_error(kwargs, message):
    kwargs = dict(kwargs)
    steps, norms = kwargs.pop("steps"), kwargs.pop("norms")
    with pytest.raises(ValueError, match=message):
        detect_overshoot(steps, norms, **kwargs)
