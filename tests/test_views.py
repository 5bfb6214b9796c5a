"""Views come with their data: typed readers, the view table of older files, generic figures,
and reports and comparisons that draw any probe's series from the view it recorded."""

import json
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest
from plotly.offline import get_plotlyjs

from dynamics.analysis.figures import SeriesView, compared_view_figure, view_figure
from dynamics.store import RunFileError, RunWriter, SeriesSpec, View, names, open_run
from dynamics.store.views import STANDARD_VIEWS, validation_view


def write_run(path, specs, rows, theta0="0" * 64):
    """A run file of ``specs`` (``{group: {series: SeriesSpec}}``) holding ``rows``
    (``{group: (steps, {series: values})}``)."""
    attrs = {names.ATTR_THETA0_SHA256: theta0} if theta0 else {}
    writer = RunWriter.create(path, specs, {}, attrs)
    for group, (steps, values) in rows.items():
        for i, step in enumerate(steps):
            writer.append(group, int(step), {k: v[i] for k, v in values.items()})
    writer.close()
    return open_run(path)


def figures_of(page: str) -> list[dict]:
    """Every figure of a page as plotly's JSON: ``{"data": [...], "layout": {...}}``."""
    calls = re.findall(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(.*?)\s*\)\s*};", page, re.S)
    decoder = json.JSONDecoder()
    found = []
    for call in calls:
        data, end = decoder.raw_decode(call)
        layout, _ = decoder.raw_decode(call[end:].lstrip(", \n"))
        found.append({"data": data, "layout": layout})
    return found


def titled(figures: list[dict], title: str) -> dict:
    """The figure titled ``title``, or with a subplot titled ``title`` (``title: <run>`` when
    it draws one panel per run)."""
    for figure in figures:
        layout = figure["layout"]
        titles = [layout.get("title", {}).get("text")]
        titles += [a.get("text") for a in layout.get("annotations", [])]
        if any(t == title or str(t).startswith(f"{title}: ") for t in titles):
            return figure
    raise AssertionError(f"no figure titled {title!r}")


def y_titles(figure: dict) -> list[str]:
    layout = figure["layout"]
    axes = [k for k in layout if k.startswith("yaxis")]
    return [layout[k].get("title", {}).get("text") for k in axes]


def test_typed_readers(tmp_path):
    t = np.arange(6)
    specs = {
        "loss": {"train": SeriesSpec()},
        "validation": {"val_acc": SeriesSpec(), "heldout_loss": SeriesSpec()},
        "custom": {"wide": SeriesSpec((3,)), "named": SeriesSpec((2,), columns=("x", "y"))},
    }
    rows = {
        "loss": (t, {"train": 1.0 / (1 + t)}),
        "validation": (t[::2], {"val_acc": t[::2] / 10, "heldout_loss": 2.0 - t[::2] / 10}),
        "custom": (t, {"wide": np.ones((6, 3)), "named": np.zeros((6, 2))}),
    }
    run = write_run(tmp_path / "a.h5", specs, rows)
    train = run.train_loss()
    assert train.name == "train" and np.allclose(train.values, 1.0 / (1 + t))
    assert set(run.validation_metrics()) == {"val_acc", "heldout_loss"}
    np.testing.assert_array_equal(run.validation_metrics()["val_acc"].step, [0, 2, 4])
    # no val_loss: the first validation metric named like a loss is the held-out loss
    assert run.heldout_loss().name == "heldout_loss"
    assert run.columns("custom", "wide") == ("wide_0", "wide_1", "wide_2")
    assert run.columns("custom", "named") == ("x", "y")
    assert run.recorded("hessian") is None and run.train_loss() is not None

    other = write_run(tmp_path / "b.h5", {"loss": specs["loss"]}, {"loss": rows["loss"]})
    stranger = write_run(tmp_path / "c.h5", {}, {}, theta0="1" * 64)
    unknown = write_run(tmp_path / "d.h5", {}, {}, theta0=None)
    assert run.shares_theta0(other) and not run.shares_theta0(stranger)
    assert not unknown.shares_theta0(unknown)  # no recorded hash: nothing to claim
    assert other.validation_metrics() == {} and other.heldout_loss() is None


def test_files_without_views_read_the_standard_ones(tmp_path):
    t = np.arange(4)
    specs = {
        "loss": {"train": SeriesSpec()},
        "validation": {"val_loss": SeriesSpec(), "val_acc": SeriesSpec()},
        "hessian": {"eigenvalues": SeriesSpec((2,)), "converged": SeriesSpec(dtype="int8")},
        "plane": {"a": SeriesSpec()},
        "custom": {"x": SeriesSpec()},
    }
    rows = {"loss": (t, {"train": t * 1.0})}
    legacy = open_run(write_run(tmp_path / "old.h5", specs, rows).path)
    assert legacy.views("loss") == STANDARD_VIEWS["loss"]
    assert legacy.views("validation") == {k: validation_view(k) for k in ("val_acc", "val_loss")}
    assert legacy.views("hessian") == {"eigenvalues": STANDARD_VIEWS["hessian"]["eigenvalues"]}
    assert legacy.views("plane") == {} and legacy.views("custom") == {}
    assert legacy.series("loss").views == STANDARD_VIEWS["loss"]

    # A file that stores views is read as it is: a series it left undrawn stays undrawn.
    specs["custom"]["x"] = SeriesSpec(view=View("scalar", "x over steps", "x"))
    modern = write_run(tmp_path / "new.h5", specs, rows)
    assert modern.views("loss") == {} and modern.views("custom")["x"].title == "x over steps"


def test_a_malformed_view_is_a_one_line_error(tmp_path):
    run = write_run(tmp_path / "run.h5", {"loss": {"train": SeriesSpec()}}, {})
    with h5py.File(run.path, "r+") as file:
        file["series/loss/train"].attrs["view"] = '{"no": "kind"}'
    with pytest.raises(RunFileError, match="series/loss/train has a view that is not one"):
        open_run(run.path)


def test_recorded_views_match_the_table_of_older_files(recorded_runs):
    run = open_run(recorded_runs[0])
    compared = 0
    for group, table in STANDARD_VIEWS.items():
        for name, view in run.views(group).items():
            if name in table:  # what the probes declare is what older files are drawn with
                assert view == table[name], (group, name)
                compared += 1
    # every one recorded, but those of measurements the fixture does not ask for
    opt_in = {
        (names.HESSIAN, names.HESSIAN_BATCH_RAYLEIGH),
        (names.HESSIAN, names.HESSIAN_BATCH_RAYLEIGH_STD),
    }
    opt_in |= {(names.HESSIAN_BLOCKS, n) for n in STANDARD_VIEWS.get(names.HESSIAN_BLOCKS, {})}
    standard = {(g, n) for g, table in STANDARD_VIEWS.items() for n in table}
    assert compared == len(standard - opt_in)
    assert run.views(names.VALIDATION) == {k: validation_view(k) for k in ("val_loss", "val_acc")}
    # drawn in the order the probes declare them, not HDF5's order by name
    assert list(run.views(names.DISPLACEMENT)) == list(STANDARD_VIEWS[names.DISPLACEMENT])
    drawn = [n for n in STANDARD_VIEWS[names.HESSIAN] if (names.HESSIAN, n) not in opt_in]
    assert list(run.views(names.HESSIAN)) == drawn


def test_view_kinds_labels_units_and_log_scale():
    t = np.arange(50)
    series = [
        SeriesView("s", View("scalar", "A scalar", "v", log_y=True, units="s"), t, t + 1.0),
        SeriesView("l", View("lines", "Lines", "w"), t, np.stack([t, -t], 1), ("p", "q")),
        SeriesView("p", View("panels", "Panels", "u"), t, np.ones((50, 3)), ("a", "b", "c")),
        SeriesView("h", View("heatmap", "Heat", "z", units="m"), t, np.ones((50, 4))),
    ]
    figure = view_figure(series, title="Group")
    layout = figure.layout
    assert layout.title.text == "Group"
    texts = [a.text for a in layout.annotations]
    assert texts[:5] == ["A scalar", "Lines", "Panels: a", "Panels: b", "Panels: c"]
    assert layout.yaxis.title.text == "v [s]" and layout.yaxis.type == "log"
    assert layout.coloraxis.colorbar.title.text == "z [m]"
    assert [trace.type for trace in figure.data].count("heatmap") == 1
    assert len([trace for trace in figure.data if trace.type == "scatter"]) == 1 + 2 + 3
    alone = view_figure(series[:1])
    assert alone.layout.title.text == "A scalar" and alone.data[0].name == "A scalar"


def test_compared_views_match_series_and_columns_across_runs():
    t = np.arange(20)
    view = View("panels", "Per layer", "n")
    a = [SeriesView("norm", view, t, np.ones((20, 2)), ("l0", "l1"))]
    b = [SeriesView("norm", view, t, np.ones((20, 2)), ("l1", "l2"))]
    figure = compared_view_figure({"a": a, "b": b})
    assert [x.text for x in figure.layout.annotations] == ["l0", "l1", "l2"]
    assert [(trace.name, trace.showlegend) for trace in figure.data] == [
        ("a", True),
        ("a", False),
        ("b", True),
        ("b", False),
    ]
    assert figure.data[0].line.color != figure.data[2].line.color


def test_report_and_compare_draw_every_recorded_view(recorded_runs, user_view, dynamics, tmp_path):
    report, compared = tmp_path / "report.html", tmp_path / "compare.html"
    for result in (
        dynamics("report", *recorded_runs, "-o", report),
        dynamics("compare", *recorded_runs, "-o", compared),
    ):
        assert result.returncode == 0, result.stderr
    for page in (report.read_text(), compared.read_text()):
        assert page.count(get_plotlyjs()) == 1
        figures = figures_of(page)
        user = titled(figures, user_view.title)  # a probe the package never heard of
        assert f"{user_view.y_label} [{user_view.units}]" in y_titles(user)
        names_drawn = {trace.get("name") for trace in user["data"]}
        assert {"weight", "bias"} <= names_drawn
        for title in (
            "Hessian trace (Hutch++)",
            "Gradient share in the top-k eigenspace",
            "Hessian spectral density",
            "Distance from initialization per tensor",
            "Validation: val_acc",
            "Hidden-state norm per layer",
        ):
            titled(figures, title)
        loss = titled(figures, "Loss")
        assert any("held-out" in trace["name"] for trace in loss["data"])
    # the report's loss figure names the held-out metric it picked
    assert "held-out (val_loss)" in {
        t["name"] for t in titled(figures_of(report.read_text()), "Loss")["data"]
    }
    density = titled(figures_of(report.read_text()), "Hessian spectral density")
    assert [trace["type"] for trace in density["data"]] == ["heatmap"]


def test_side_by_side_panels_say_whose_data_they_show(recorded_runs, tmp_path):
    from dynamics.analysis.pages.run_comparison import write_comparison

    page = write_comparison(recorded_runs, tmp_path / "compare.html").path.read_text()
    figures = figures_of(page)
    labels = [path.stem for path in recorded_runs]  # lr0.3, lr0.1

    def panel_titles(title: str) -> list[str]:
        return [a.get("text") for a in titled(figures, title)["layout"].get("annotations", [])]

    # per-tensor displacement is one panel per run; so is the spectral density
    per_tensor = "Distance from initialization per tensor"
    assert [t for t in panel_titles("Displacement") if t.startswith(per_tensor)] == [
        f"{per_tensor}: run {label}" for label in labels
    ]
    assert panel_titles("Hessian spectral density") == [f"run {label}" for label in labels]
    # overlaid panels name each run in the legend instead
    accuracy = titled(figures, "Validation: val_acc")
    assert [trace["name"] for trace in accuracy["data"]] == labels


def test_the_plane_page_uses_the_page_kit(tmp_path):
    from dynamics.analysis.pages.plane import write_plane_html
    from dynamics.geometry.landscape import PlaneView, Trajectory
    from dynamics.geometry.plane import Grid, Plane

    plane = Plane(np.zeros(3), np.eye(3)[0], np.eye(3)[1], kind="gradients")
    grid = Grid(np.linspace(-1, 1, 5), np.linspace(-1, 1, 4))
    path = np.linspace(0, 0.5, 6)
    trajectory = Trajectory("a", np.arange(6), path, -path, path / 10, 1 - path, 1 - path / 2)
    views = [
        PlaneView("plane of a", plane, grid, "a", np.ones(grid.shape), [trajectory], {"n": 0.5})
    ]
    written = write_plane_html(views, tmp_path / "plane.html")  # the CLI's call, unchanged
    page = written.path.read_text()
    style = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    assert page.count(get_plotlyjs()) == 1 and "font-family:system-ui" in style
    # laid out as the report and comparison are: a meta line, sections, notes in the kit's style
    assert "<p class='meta'>a · dynamics" in page and "<h2>Loss landscapes</h2>" in page
    assert "<h2>Notes</h2>" in page and "<p class='note'>" in page
    assert written.figures == 2 and page.count("Plotly.newPlot(") == 2
    exported = write_plane_html(
        views, tmp_path / "again.html", static_dir=tmp_path / "svg", static_format="svg"
    )
    if exported.static_skipped is None:  # kaleido and a Chromium installed
        assert sorted(p.name for p in exported.static_files) == [
            "plane-checkpoint-loss.svg",
            "plane-heatmaps.svg",
        ]


def test_drawing_a_recorded_density_needs_no_torch(recorded_runs, tmp_path):
    out = tmp_path / "r.html"
    argv = ["report", str(recorded_runs[0]), "-o", str(out)]
    script = f"from dynamics.cli import main\nassert main({argv!r}) == 0"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", script], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Hessian spectral density" in out.read_text()
    assert not re.findall(r"\|\s+(torch|pytorch_lightning)$", result.stderr, re.M)
