"""The sweep page in headless Chromium (the harness of test_browser): no errors, no request
off the machine, one drawn heatmap per claim over a two-key grid, and links that resolve."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from dynamics.experiments.paper.claims import CLAIMS
from tests.conftest import TINY_EXPERIMENT, run_dynamics
from tests.devtools import NEEDS_CHROMIUM, DevTools
from tests.test_browser import LOCAL_SCHEMES

pytestmark = NEEDS_CHROMIUM

#: Per plotly figure: an SVG plot, its traces, and the heatmap images drawn with their cells.
HEATMAPS = """JSON.stringify([...document.querySelectorAll('.plotly-graph-div')].map(d => ({
  svg: d.classList.contains('js-plotly-plot') && !!d.querySelector('svg.main-svg'),
  types: (d._fullData || []).map(t => t.type),
  images: d.querySelectorAll('.heatmaplayer .hm image').length,
  labels: [...d.querySelectorAll('.heatmaplayer text, .hm text, text.heatmap-label')].length,
})))"""


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    """A 2 × 2 sweep (learning rate × optimizer), one seed, 20 steps: its output folder."""
    folder = tmp_path_factory.mktemp("sweep_browser")
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    result = run_dynamics(
        "sweep",
        folder / "tiny.yaml",
        "--grid",
        "optimizer.lr=1e-3,1e-2",
        "--grid",
        "optimizer.name=adam,sgd",
        "--seeds",
        "0",
        "--steps",
        "20",
        "--jobs",
        "1",
        "--no-progress",
        "--out",
        folder / "out",
    )
    assert result.returncode == 0, result.stderr
    return folder / "out"


def test_the_sweep_page_renders_a_heatmap_per_claim(swept):
    page = swept / "sweep.html"
    devtools = DevTools(swept.parent / "profile")
    try:
        session = devtools.open(page.resolve().as_uri())
        deadline = time.monotonic() + 30
        plots = json.loads(devtools.evaluate(HEATMAPS, session))
        while not all(p["svg"] and p["images"] for p in plots) and time.monotonic() < deadline:
            time.sleep(0.2)
            plots = json.loads(devtools.evaluate(HEATMAPS, session))
        errors = devtools.errors(session)
        external = [u for u in devtools.requests(session) if not u.startswith(LOCAL_SCHEMES)]
    finally:
        devtools.close()
    assert errors == [] and external == []
    claims = [c for c in CLAIMS if c.experiment == "teacher_student"]
    assert len(plots) == len(claims)
    for plot in plots:
        assert plot["svg"] and plot["types"] == ["heatmap"] and plot["images"] == 1, plot


def test_every_link_of_the_sweep_page_resolves(swept):
    body = (swept / "sweep.html").read_text().split("</head>")[1]  # not plotly.js's own
    links = re.findall(r"<a href='([^']+)'", body)
    cells = sorted(p.name for p in (swept / "cells").iterdir())
    assert len(cells) == 4
    assert sorted(set(links)) == sorted(f"cells/{name}/compare.html" for name in cells)
    for link in links:
        assert (swept / link).is_file(), link
