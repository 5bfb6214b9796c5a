"""Views that misled (issue 22 items 12 and 13): the barrier column, the crossover of sparse
evaluations, log-axis tick labels, the plane page's run colours, and plane_path of several runs."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dynamics.analysis import figures
from dynamics.analysis.figures.plane import checkpoint_loss_figure, heatmap_figure
from dynamics.analysis.measures.loss_barrier import Barriers, LinePath
from dynamics.analysis.measures.run_comparison import crossing_text, crossover
from dynamics.analysis.pages.sections.loss_barrier import barrier_html
from dynamics.errors import DynamicsError
from dynamics.store import RunWriter, SeriesSpec


def test_a_line_that_only_falls_has_no_barrier_and_the_other_definition_is_labelled():
    alphas = np.linspace(0, 1, 5)
    falling = LinePath("θ0 → θT (a)", "a", False, alphas, 3.0 - 2.0 * alphas, "probe batch")
    page = barrier_html(Barriers([falling], []))
    header = re.findall(r"<th>(.*?)</th>", page)
    assert header[4:6] == ["barrier (height above the chord)", "max − mean of the ends"]
    cells = re.findall(r"<td>(.*?)</td>", page)
    # By hand: the chord is the line itself (height 0); max 3 − mean of the ends 2 = 1.
    assert cells[4:6] == ["0", "1"]


def test_a_crossover_between_sparse_evaluations_is_reported_as_their_interval():
    steps = np.arange(0, 1001, 100)  # evaluated every 100 steps
    a = 1.0 - 5e-4 * steps
    b = 1.105 - 7e-4 * steps  # by hand: b − a = 0.105 − 2e-4 s crosses zero at s = 525
    result = crossover(steps, a, steps, b, ("a", "b"), fraction=0)
    assert result.winner == "b" and result.bracket == (500, 600)
    assert result.step == pytest.approx(525)
    assert crossing_text(result) == "between 500 and 600 (interpolated 525)"
    # Evaluated every step, the interpolated step is the answer itself.
    dense = np.arange(0, 1001)
    result = crossover(dense, 1.0 - 5e-4 * dense, dense, 1.105 - 7e-4 * dense, fraction=0)
    assert result.bracket == (525, 525) and crossing_text(result) == "525"


def test_a_crossover_read_between_the_other_runs_records_is_bracketed_by_them():
    result = crossover(
        np.arange(0, 1001, 10),
        1.0 - 5e-4 * np.arange(0, 1001, 10),
        np.arange(0, 1001, 100),
        1.105 - 7e-4 * np.arange(0, 1001, 100),
        fraction=0,
    )
    assert result.bracket == (500, 600)  # b's records, not a's 520–530


def test_log_axes_label_ticks_with_their_whole_values():
    curve = figures.Curve("λ1", np.arange(10), np.geomspace(1.5, 40, 10))
    axis = figures.line_figure([curve], title="λ1", y_title="λ1", log_y=True).layout.yaxis
    assert (axis.type, axis.tickformat, axis.dtick) == ("log", ".3~g", "D2")
    wide = figures.Curve("loss", np.arange(10), np.geomspace(1e-4, 10, 10))
    axis = figures.line_figure([wide], title="loss", y_title="loss", log_y=True).layout.yaxis
    assert (axis.tickformat, axis.dtick) == (".3~g", None)  # decades: plotly's own ticks
    linear = figures.line_figure([curve], title="λ1", y_title="λ1").layout.yaxis
    assert linear.type == "linear" and linear.tickformat is None


def _view(kind: str, runs: tuple[str, ...]) -> SimpleNamespace:
    grid = SimpleNamespace(alphas=np.linspace(-1, 1, 3), betas=np.linspace(-1, 1, 3))
    trajectories = [
        SimpleNamespace(
            run=run,
            a=np.array([0.0, 0.5]),
            b=np.array([0.0, 0.1 * i]),
            step=np.array([0, 10]),
            loss=np.array([1.0, 0.5]),
            plane_loss=np.array([1.0, 0.6]),
        )
        for i, run in enumerate(runs)
    ]
    return SimpleNamespace(
        title=kind,
        run=runs[0],
        losses=np.ones((3, 3)),
        coarse_losses=None,
        coarse_grid=None,
        grid=grid,
        refine=None,
        trajectories=trajectories,
        plane=SimpleNamespace(kind=kind),
        buffer_regions=None,
    )


def test_the_plane_page_draws_each_run_in_one_colour_everywhere():
    views = [_view("gradients", ("a", "b")), _view("out-of-plane", ("b", "a"))]
    colours: dict[str, set] = {}
    for trace in heatmap_figure(views).data:
        if trace.type == "scatter" and trace.mode == "lines+markers":
            colours.setdefault(trace.name, set()).update({trace.line.color, trace.marker.color})
    for trace in checkpoint_loss_figure(views).data:
        colours.setdefault(trace.name.split(":")[0], set()).add(trace.line.color)
    assert all(len(c) == 1 for c in colours.values()), colours
    assert colours["a"] != colours["b"]


def _plane_run(path, a, b, basis):
    series = {"plane": {"a": SeriesSpec(), "b": SeriesSpec()}}
    vectors = {"plane_u": SeriesSpec((3,)), "plane_v": SeriesSpec((3,))}
    writer = RunWriter.create(path, series, vectors, {"run_name": path.stem})
    writer.write_vector("plane_u", basis[0])
    writer.write_vector("plane_v", basis[1])
    for step, (x, y) in enumerate(zip(a, b)):
        writer.append("plane", step, {"a": x, "b": y})
    writer.close()
    return path


def test_plane_path_draws_several_runs_on_one_plane_and_refuses_two_planes(tmp_path):
    basis = (np.array([1.0, 0, 0]), np.array([0, 1.0, 0]))
    a = _plane_run(tmp_path / "a.h5", [0, 1, 2], [0, 0.5, 1], basis)
    b = _plane_run(tmp_path / "b.h5", [0, -1, -2], [0, 0.2, 0.1], basis)
    figure = figures.plane_path([a, b])
    paths = [t for t in figure.data if t.showlegend is not False]
    assert [t.name for t in paths] == ["a", "b"]
    np.testing.assert_array_equal(paths[1].x, [0, -1, -2])
    assert all(t.line.color == t.marker.color for t in paths)
    assert paths[0].line.color != paths[1].line.color
    assert figures.plane_path(a).data[0].name == "trajectory"  # one run: as the report draws it
    other = (np.array([0, 0, 1.0]), np.array([0, 1.0, 0]))
    c = _plane_run(tmp_path / "c.h5", [0, 1], [0, 1], other)
    with pytest.raises(DynamicsError, match="different planes"):
        figures.plane_path([a, c])


class _NormedLine(torch.nn.Module):
    """A loss that reads BatchNorm's running mean in eval mode: it jumps where buffers switch."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1, bias=False)
        self.bn = torch.nn.BatchNorm1d(1)

    def dynamics_loss(self, batch):
        return self.bn(self.w(batch)).pow(2).mean()


def test_buffer_regions_are_the_states_whose_buffers_each_grid_point_was_evaluated_with():
    from dynamics.geometry.landscape import LossSurface, evaluate_grid
    from dynamics.geometry.nearest_buffers import NearestBuffers
    from dynamics.geometry.plane import Grid, Plane
    from dynamics.params.layout import BufferLayout, ParameterLayout
    from dynamics.params.vectors import parameter_vector
    from dynamics.store import StoredState

    torch.manual_seed(0)
    module = _NormedLine().eval()
    layout, buffer_layout = ParameterLayout.of(module), BufferLayout.of(module)
    theta0 = parameter_vector(module, layout).double().numpy()
    states = []
    for shift, mean in ((0.0, 0.0), (1.0, 3.0)):  # θ0 and a state one unit along u
        module.bn.running_mean.fill_(mean)
        buffers = {d: b.numpy().copy() for d, b in buffer_layout.vectors(module).items()}
        theta = theta0 + shift * np.eye(theta0.size)[0]
        states.append(StoredState(0, "snapshot", theta.astype(np.float32), buffers))
    rule = NearestBuffers(states, buffer_layout, "two states")
    batch = torch.randn(8, 2)
    surface = LossSurface(module, layout, batch, buffers=rule)
    basis = np.eye(theta0.size)
    plane = Plane(theta0, basis[0], basis[1], "gradients")
    grid = Grid(np.linspace(-1, 2, 7), np.linspace(-1, 1, 5))
    regions = surface.buffer_regions(plane, grid)
    assert regions.shape == grid.shape and set(np.unique(regions)) == {0, 1}
    # By hand: the states differ by one unit along u, so the switch is at a = 0.5.
    np.testing.assert_array_equal(regions, np.broadcast_to(grid.alphas > 0.5, grid.shape))
    losses = evaluate_grid(surface, plane, grid)
    for (i, j), index in np.ndenumerate(regions):
        point = theta0 + grid.alphas[j] * basis[0] + grid.betas[i] * basis[1]
        copy = _NormedLine().eval()
        for p, value in zip(layout.parameters(copy), layout.split(torch.tensor(point).float())):
            p.data.copy_(value.view_as(p))
        buffer_layout.load(copy, states[index].buffers)
        with torch.no_grad():
            assert losses[i, j] == pytest.approx(float(copy.dynamics_loss(batch)), rel=1e-5)


def test_the_heatmap_marks_where_the_buffers_switch():
    view = _view("gradients", ("a",))
    view.buffer_regions = np.array([[0, 0, 4], [0, 4, 4], [4, 4, 4]])
    marks = [t for t in heatmap_figure([view]).data if t.name and "buffers switch" in t.name]
    assert len(marks) == 1 and marks[0].contours.coloring == "none"
    np.testing.assert_array_equal(marks[0].z, [[0, 0, 1], [0, 1, 1], [1, 1, 1]])
    view.buffer_regions = np.zeros((3, 3), int)  # one state throughout: nothing to mark
    assert not [t for t in heatmap_figure([view]).data if t.name and "switch" in t.name]


def _heldout_run(path, values, steps):
    series = {"loss": {"train": SeriesSpec()}, "validation": {"val_loss": SeriesSpec()}}
    writer = RunWriter.create(path, series, {}, {"run_name": path.stem})
    for step, value in zip(steps, values):
        writer.append("loss", int(step), {"train": float(value)})
        writer.append("validation", int(step), {"val_loss": float(value)})
    writer.close()
    return path


def test_the_seed_summary_gives_the_evaluations_that_bracket_every_seeds_crossing(tmp_path):
    from dynamics.experiments.runner import VariantResult
    from dynamics.experiments.seed_runs import crossover_steps

    steps = np.arange(0, 1001, 100)
    results = {}
    for seed, offset in ((0, 0.105), (1, 0.125)):  # by hand: crossings at 525 and 625
        for variant, values in (
            ("none", 1.0 - 5e-4 * steps),
            ("shifted", 1.0 + offset - 7e-4 * steps),
        ):
            path = _heldout_run(tmp_path / f"{variant}{seed}.h5", values, steps)
            nan = float("nan")
            results[variant, seed] = VariantResult(variant, variant, path, nan, nan, nan, None, "")
    entry = crossover_steps({"none": "none", "shifted": "expected"}, results)["shifted"]
    assert entry["bracket"] == [500, 700]
    assert entry["n"] == 2 and 500 < entry["min"] < entry["max"] < 700
