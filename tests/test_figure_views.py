"""The public views of runs (dynamics.analysis.figures): one call, one plotly figure, drawing
exactly what the run recorded."""

from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest

from dynamics import open_run
from dynamics.analysis import figures
from dynamics.analysis.measures.overshoot import detect_overshoot
from dynamics.errors import DynamicsError
from dynamics.store import RunWriter, SeriesSpec, View, names

PEAK_STEP = 60  # of the synthetic run whose first layer overshoots


@pytest.fixture(scope="module")
def run(recorded_runs):
    return open_run(recorded_runs[0])


def _lines(figure: go.Figure) -> dict[str, go.Scatter]:
    return {trace.name: trace for trace in figure.data if isinstance(trace, go.Scatter)}


def _window(run):
    """The window of fastest loss descent, judged directly from the recorded series."""
    norms, loss = run.series(names.HIDDEN_NORMS), run.train_loss()
    report = detect_overshoot(norms.step, norms["norm"], loss_steps=loss.step, loss=loss.values)
    window = report.loss_window
    return (window.start_step, window.end_step) if window.found else None


def test_loss_draws_the_recorded_training_and_heldout_loss_with_its_window(run):
    figure = figures.loss(run)
    assert isinstance(figure, go.Figure) and figure.layout.title.text == "Loss"
    lines = _lines(figure)
    assert list(lines) == ["train", "held-out (val_loss)"]
    np.testing.assert_array_equal(lines["train"].x, run.train_loss().step)
    np.testing.assert_array_equal(lines["train"].y, run.train_loss().values)
    np.testing.assert_array_equal(lines["held-out (val_loss)"].y, run.heldout_loss().values)
    window = _window(run)
    assert window is not None  # this run's loss has a window of fastest descent
    (shade,) = figure.layout.shapes
    assert (shade.x0, shade.x1) == window


def test_several_runs_are_overlaid_one_colour_each(recorded_runs):
    figure = figures.loss(recorded_runs, labels=["fast", "slow"])
    lines = _lines(figure)
    assert list(lines) == ["fast train", "fast held-out", "slow train", "slow held-out"]
    slow = open_run(recorded_runs[1])
    np.testing.assert_array_equal(lines["slow train"].y, slow.train_loss().values)
    assert lines["fast train"].line.color == lines["fast held-out"].line.color
    assert lines["fast train"].line.color != lines["slow train"].line.color
    assert lines["slow held-out"].line.dash == "dash"


def test_hidden_norms_eigenvalues_and_displacement_draw_their_recorded_columns(run):
    norms = run.series(names.HIDDEN_NORMS)
    lines = _lines(figures.hidden_norms(run))
    layers = run.columns(names.HIDDEN_NORMS, names.HIDDEN_NORM)
    assert list(lines) == list(layers)
    for j, layer in enumerate(layers):
        np.testing.assert_array_equal(lines[layer].y, norms["norm"][:, j])
    hessian = run.series(names.HESSIAN)
    figure = figures.eigenvalues(run)
    assert figure.layout.title.text == "Top Hessian eigenvalues"
    lines = _lines(figure)
    assert list(lines) == ["lambda_1", "lambda_2"]
    np.testing.assert_array_equal(lines["lambda_2"].x, hessian.step)
    np.testing.assert_array_equal(lines["lambda_2"].y, hessian["eigenvalues"][:, 1])
    displacement = run.series(names.DISPLACEMENT)
    lines = _lines(figures.displacement(run))
    tensors = run.columns(names.DISPLACEMENT, names.DISPLACEMENT_PER_TENSOR)
    assert set(lines) == {"Distance from initialization", "Update size", *tensors}
    np.testing.assert_array_equal(lines["Distance from initialization"].y, displacement["total"])
    np.testing.assert_array_equal(lines[tensors[-1]].y, displacement["per_tensor"][:, -1])


def test_any_group_is_drawn_from_its_views_and_the_density_as_a_heatmap(run, user_view):
    figure = figures.group(run, "head_norms")  # a user's probe, known to no module
    assert figure.layout.title.text == user_view.title
    lines = _lines(figure)
    assert list(lines) == ["weight", "bias"]
    np.testing.assert_array_equal(lines["bias"].y, run.series("head_norms")["norm"][:, 1])
    (heat,) = figures.spectral_density(run).data
    assert isinstance(heat, go.Heatmap)
    np.testing.assert_array_equal(heat.x, run.series(names.HESSIAN).step)


def test_views_take_paths_and_compare_several_runs(recorded_runs):
    figure = figures.eigenvalues([str(recorded_runs[0]), Path(recorded_runs[1])])
    assert [t.name for t in figure.data] == ["lambda_1", "lambda_2"] * 2  # a panel per run
    (first, second) = (open_run(p).name for p in recorded_runs)
    titles = " · ".join(a.text for a in figure.layout.annotations)  # panel titles
    assert first in titles and second in titles
    assert len(figures.spectral_density(recorded_runs).data) == 2


def test_overshoot_peaks_are_starred_where_the_norm_peaks(tmp_path):
    path = overshooting_run(tmp_path)
    figure = figures.hidden_norms(path)
    (stars,) = [t for t in figure.data if t.name == "overshoot peak"]
    assert list(stars.x) == [PEAK_STEP]
    norms = open_run(path).series(names.HIDDEN_NORMS)["norm"]
    # The peak of the smoothed norm: above the settled level, at most the raw maximum.
    assert norms[-1, 0] < stars.y[0] <= norms[:, 0].max()
    assert len(figure.layout.shapes) >= 1  # the window of fastest loss descent, shaded


def overshooting_run(folder: Path) -> Path:
    """A run whose first layer's norm rises to a peak at PEAK_STEP and settles below it while
    the loss falls fastest around that step; its second layer's norm only grows."""
    steps = np.arange(200)
    bump = 1.0 + 3.0 * np.exp(-(((steps - PEAK_STEP) / 12.0) ** 2))
    grow = 1.0 + steps / 200
    loss = 1.0 / (1.0 + np.exp((steps - PEAK_STEP) / 8.0)) + 0.05
    view = View("panels", "Hidden-state norm per layer", "mean ‖h‖")
    series = {
        names.LOSS: {names.LOSS_TRAIN: SeriesSpec()},
        names.HIDDEN_NORMS: {names.HIDDEN_NORM: SeriesSpec((2,), columns=("a", "b"), view=view)},
    }
    path = folder / "overshoot.h5"
    writer = RunWriter.create(path, series, {}, {})
    for step in steps:
        writer.append(names.LOSS, int(step), {names.LOSS_TRAIN: np.float32(loss[step])})
        norm = np.array([bump[step], grow[step]], dtype=np.float32)
        writer.append(names.HIDDEN_NORMS, int(step), {names.HIDDEN_NORM: norm})
    writer.close()
    return path


def test_plane_path_and_share_match_the_recorded_displacement(demo):
    folder, _ = demo
    run = open_run(folder / "runs" / "shifted.h5")
    plane = run.series(names.PLANE)
    path = _lines(figures.plane_path(run))["trajectory"]
    np.testing.assert_array_equal(path.x, plane["a"])
    np.testing.assert_array_equal(path.y, plane["b"])
    share = _lines(figures.plane_share(run))["(a² + b²) / ‖θt − θ0‖²"]
    # Independent reference: ‖θt − θ0‖ as the displacement probe recorded it.
    displacement = run.series(names.DISPLACEMENT)
    steps, at_plane, at_displacement = np.intersect1d(
        plane.step, displacement.step, return_indices=True
    )
    assert len(steps) > 3
    inside = plane["a"][at_plane].astype(float) ** 2 + plane["b"][at_plane].astype(float) ** 2
    total = displacement["total"][at_displacement].astype(float) ** 2
    moved = total > 0
    np.testing.assert_allclose(
        np.asarray(share.y)[at_plane][moved], inside[moved] / total[moved], rtol=1e-3
    )


def test_a_view_a_run_did_not_record_is_one_clear_error(run, recorded_runs, tmp_path):
    with pytest.raises(DynamicsError, match=r"no plane coordinates \(a, b\) recorded$"):
        figures.plane_path(run)
    synthetic = overshooting_run(tmp_path)  # norms and loss only
    with pytest.raises(DynamicsError, match=r"no 'hessian' recorded \(it recorded hidden_norms"):
        figures.eigenvalues(synthetic)
    with pytest.raises(DynamicsError, match="figures.loss draws the loss$"):
        figures.group(synthetic, names.LOSS)
    with pytest.raises(DynamicsError, match="1 labels for 2 runs"):
        figures.loss(recorded_runs, labels=["one"])
    with pytest.raises(DynamicsError, match="no such file"):
        figures.loss(tmp_path / "missing.h5")
