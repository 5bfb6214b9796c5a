"""The grouped comparison page renders offline in a browser (the harness of test_browser)."""

from __future__ import annotations

from dynamics.analysis.measures.seed_groups import load_groups
from dynamics.analysis.pages.group_comparison import write_group_comparison
from tests.test_browser import DevTools, pytestmark, rendered  # noqa: F401  (skips without Chromium)
from tests.test_groups import SEEDS, write_run


def test_grouped_page_renders_every_band(tmp_path):
    for variant in ("unshifted", "shifted"):
        (tmp_path / variant).mkdir()
        for seed in SEEDS:
            write_run(tmp_path / variant / f"seed{seed}.h5", variant, seed)
    groups = load_groups([(v, tmp_path / v) for v in ("unshifted", "shifted")])
    written = write_group_comparison(groups, None, tmp_path / "groups.html")
    assert written.figures == 3  # training loss, held-out loss, λ1
    devtools = DevTools(tmp_path / "profile")
    try:
        plots, errors, external = rendered(devtools, tmp_path / "groups.html")
    finally:
        devtools.close()
    assert errors == [] and external == []
    assert len(plots) == 3
    for plot in plots:
        assert plot["traces"] == 4  # per group: the min–max band and the mean
        assert plot["drawn"] == plot["with_data"] == plot["traces"], plot
