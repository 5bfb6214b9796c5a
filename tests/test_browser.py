"""The report and the comparison in a real browser: headless Chromium opens them from file://.

Chromium is driven over the DevTools protocol on a pipe (:mod:`tests.devtools`): the test
records JavaScript exceptions, console errors, log errors and every request the page makes,
waits until plotly has drawn, then checks each figure: an SVG plot whose traces were all drawn
with data. It skips without Chromium, and fails so under CI.
"""

import json
import time
from pathlib import Path

import numpy as np
import pytest

from dynamics.analysis.pages.run_comparison import write_comparison
from dynamics.analysis.pages.run_report import write_report
from dynamics.store import RunWriter, SeriesSpec, View, names
from tests.devtools import NEEDS_CHROMIUM, DevTools

pytestmark = NEEDS_CHROMIUM

#: For every plotly figure: is it an SVG plot, how many traces it holds, how many of them were
#: drawn, and how many were drawn with at least one point or line segment.
PLOTS = """JSON.stringify([...document.querySelectorAll('.plotly-graph-div')].map(d => {
  const traces = [...d.querySelectorAll('.scatterlayer .trace')];
  const line = t => [...t.querySelectorAll('path.js-line')]
    .some(p => (p.getAttribute('d') || '').length > 1);
  const drawn = t => line(t) || t.querySelectorAll('.point').length > 0;
  return {
    id: d.id,
    svg: d.classList.contains('js-plotly-plot') && !!d.querySelector('svg.main-svg'),
    traces: (d._fullData || []).length,
    drawn: traces.length,
    with_data: traces.filter(drawn).length,
  };
}))"""
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")


def rendered(
    devtools: DevTools, path: Path, wait_s: float = 30.0
) -> tuple[list[dict], list[str], list[str]]:
    """Open ``path``; wait until every figure is drawn (or ``wait_s``); plots, errors, requests."""
    session = devtools.open(path.resolve().as_uri())
    deadline = time.monotonic() + wait_s
    plots = json.loads(devtools.evaluate(PLOTS, session))
    while not all(p["svg"] and p["drawn"] == p["traces"] for p in plots):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
        plots = json.loads(devtools.evaluate(PLOTS, session))
    external = [u for u in devtools.requests(session) if not u.startswith(LOCAL_SCHEMES)]
    return plots, devtools.errors(session), external


def write_run(path: Path, eigen_scale: float, lag: float) -> Path:
    """A run with every group a report draws (hessian and plane included)."""
    t = np.arange(600)
    layers = ("blocks.0", "blocks.1")
    norms = np.stack([10 + 3 * np.exp(-(((t - 150) / 50) ** 2)), 10 + (1 - np.exp(-t / 90))], 1)
    rows = {
        "loss": (t, {"train": np.exp(-t / (80 * lag)) + 0.1}),
        "validation": (t[::50], {"val_loss": np.exp(-t[::50] / (80 * lag)) + 0.1 / lag}),
        "hidden_norms": (t, {"norm": norms}),
        "activation_bias": (t, {"mean": np.stack([0.4 - t / 6000] * 2, 1)}),
        "displacement": (t, {"total": np.sqrt(t), "update": 1 / (1 + t)}),
        "hessian": (t[::25], {"eigenvalues": eigen_scale * np.outer(1 + t[::25] / 600, [5, 2])}),
        "plane": (t, {"a": t / 600, "b": np.sin(t / 100) / 10, "r": t / 6000}),
    }
    specs = {
        "loss": {"train": SeriesSpec()},
        "validation": {"val_loss": SeriesSpec()},
        "hidden_norms": {"norm": SeriesSpec((2,), columns=layers)},
        "activation_bias": {"mean": SeriesSpec((2,), columns=layers)},
        "displacement": {"total": SeriesSpec(), "update": SeriesSpec()},
        "hessian": {"eigenvalues": SeriesSpec((2,), columns=("lambda_1", "lambda_2"))},
        "plane": {"a": SeriesSpec(), "b": SeriesSpec(), "r": SeriesSpec()},
    }
    attrs = {"config": {"variant": path.stem}, "theta0_sha256": "0" * 64}
    writer = RunWriter.create(path, specs, {}, attrs, block_rows=4096)
    for group, (steps, values) in rows.items():
        for i, step in enumerate(steps):
            writer.append(group, int(step), {k: v[i] for k, v in values.items()})
    writer.close()
    return path


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pages")
    runs = [write_run(folder / "fast.h5", 1.0, 1.0), write_run(folder / "slow.h5", 0.1, 1.5)]
    report = write_report(runs, folder / "report.html")
    comparison = write_comparison(runs, folder / "compare.html")
    (folder / "broken.html").write_text(
        "<div class='plotly-graph-div' id='never-drawn'></div>"
        "<img src='http://127.0.0.1:9/missing.png'><script>undefinedFunction()</script>"
    )
    devtools = DevTools(folder / "profile")
    yield devtools, folder, {"report": report.figures, "compare": comparison.figures}
    devtools.close()


@pytest.mark.parametrize("page", ["report", "compare"])
def test_every_figure_renders_offline_without_errors(pages, page):
    devtools, folder, figures = pages
    plots, errors, external = rendered(devtools, folder / f"{page}.html")
    assert errors == []
    assert external == []  # opens offline: nothing but the file itself is fetched
    assert len(plots) == figures[page] and figures[page] >= 8
    for plot in plots:
        assert plot["svg"] and plot["traces"] > 0, plot
        assert plot["drawn"] == plot["traces"] and plot["with_data"] == plot["traces"], plot


def test_the_harness_sees_errors_undrawn_plots_and_requests(pages):
    devtools, folder, _ = pages
    plots, errors, external = rendered(devtools, folder / "broken.html", wait_s=1)
    assert plots == [{"id": "never-drawn", "svg": False, "traces": 0, "drawn": 0, "with_data": 0}]
    assert any("undefinedFunction" in error for error in errors)
    assert external == ["http://127.0.0.1:9/missing.png"]


def test_static_export_of_each_figure(tmp_path):
    pytest.importorskip("kaleido", reason="static export needs kaleido (pip install kaleido)")
    run = write_run(tmp_path / "run.h5", 1.0, 1.0)
    written = write_report(
        [run], tmp_path / "r.html", static_dir=tmp_path / "svg", static_format="svg"
    )
    assert written.static_skipped is None, written.static_skipped
    assert len(written.static_files) == written.figures
    assert all(f.read_text().lstrip().startswith("<svg") for f in written.static_files)


#: The figure titled ``title`` as drawn: its title text in the SVG, the y-axis titles, and
#: whether each of its traces was drawn with data (null when no figure has that title).
FIGURE = """(title => {
  const d = [...document.querySelectorAll('.plotly-graph-div')]
    .find(d => d.layout && d.layout.title && d.layout.title.text === title);
  if (!d) return null;
  const traces = [...d.querySelectorAll('.scatterlayer .trace')];
  const line = t => [...t.querySelectorAll('path.js-line')]
    .some(p => (p.getAttribute('d') || '').length > 1);
  return JSON.stringify({
    title: (d.querySelector('.gtitle') || {}).textContent,
    y_titles: [...d.querySelectorAll('.ytitle')].map(t => t.textContent),
    legend: [...d.querySelectorAll('.legendtext')].map(t => t.textContent),
    traces: (d._fullData || []).length,
    with_data: traces.filter(t => line(t) || t.querySelectorAll('.point').length > 0).length,
  });
})"""


@pytest.mark.parametrize("page", ["report", "compare"])
def test_a_users_probe_is_drawn_with_its_declared_labels(
    pages, recorded_runs, user_view, dynamics, tmp_path, page
):
    devtools, _, _ = pages
    out = tmp_path / f"{page}.html"
    result = dynamics(page, *recorded_runs, "-o", out)
    assert result.returncode == 0, result.stderr
    session = devtools.open(out.resolve().as_uri())
    view = user_view
    deadline = time.monotonic() + 30
    while True:
        found = devtools.evaluate(f"{FIGURE}({json.dumps(view.title)})", session)
        drawn = found and json.loads(found)
        if (drawn and drawn["with_data"] == drawn["traces"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert drawn, f"no figure titled {view.title!r} in the {page}"
    assert drawn["title"] == view.title
    assert f"{view.y_label} [{view.units}]" in drawn["y_titles"]
    assert {"weight", "bias"} <= set(drawn["legend"])
    assert drawn["traces"] > 0 and drawn["with_data"] == drawn["traces"], drawn
    assert devtools.errors(session) == []


#: Strings a crafted file may hold, each of which would set ``window.injected`` if a page
#: let it through as markup.
INJECTED = (
    "<script>window.injected = 'script'</script>",
    "<img src=x onerror=\"window.injected = 'img'\">",
    "</script><script>window.injected = 'closed'</script>",
)


def test_strings_from_a_file_never_run_as_markup(pages, tmp_path):
    """A run name, layer names, a series' title and config values reach the pages as text."""
    devtools, _, _ = pages
    t = np.arange(20)
    layers = (INJECTED[1], INJECTED[2])
    view = View("scalar", INJECTED[0], INJECTED[1], units=INJECTED[2])
    specs = {
        "loss": {"train": SeriesSpec()},
        "hidden_norms": {"norm": SeriesSpec((2,), columns=layers)},
        "custom": {"value": SeriesSpec(view=view)},
    }
    runs = []
    for i, name in enumerate(INJECTED[:2]):
        attrs = {
            names.ATTR_RUN_NAME: name,
            "config": {INJECTED[0]: INJECTED[2], "variant": INJECTED[1], "i": i},
            "theta0_sha256": "0" * 64,
        }
        path = tmp_path / f"run{i}.h5"
        writer = RunWriter.create(path, specs, {}, attrs)
        for step in t:
            writer.append("loss", int(step), {"train": 1.0 / (1 + step)})
            writer.append("hidden_norms", int(step), {"norm": np.array([1.0, 2.0]) * step})
            writer.append("custom", int(step), {"value": float(step)})
        writer.close()
        runs.append(path)
    written = [
        write_report(runs, tmp_path / "report.html").path,
        write_comparison(runs, tmp_path / "compare.html").path,
    ]
    for page in written:
        text = page.read_text()
        assert INJECTED[0] not in text and "&lt;script&gt;window.injected" in text
        plots, errors, external = rendered(devtools, page)
        session = devtools.open(page.resolve().as_uri())
        assert devtools.evaluate("String(window.injected)", session) == "undefined"
        assert errors == [] and external == []
        assert plots and all(p["svg"] for p in plots)
