"""Grouped comparison over seeds: the paired statistics as a table (the terminal and the page
print the same rows), as JSON, and as one HTML page with bands instead of one line per run.

Bands are the mean over seeds and the min–max envelope (not a confidence interval): each
seed's series is read at the steps of the group's first seed inside the range all seeds cover
(linear interpolation, exact when the schedules agree).
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from dynamics import __version__
from dynamics.analysis.comparison import comparability, finite, top_eigenvalue, verdict
from dynamics.analysis.figures import run_colors, y_scale
from dynamics.analysis.groups import Group, GroupComparison, compare_groups
from dynamics.analysis.output import check_output
from dynamics.analysis.page import Written, figure_html, html_page, html_table, write_page
from dynamics.analysis.paired_statistics import RATIO, VALUE, PairedStatistic
from dynamics.store import Metric, Run

__all__ = ["STATISTICS_HEADER", "groups_json", "statistics_rows", "write_group_comparison"]

STATISTICS_HEADER = (
    "comparison",
    "measure",
    "centre",
    "interval",
    "method",
    "sign test p",
    "seeds agreeing",
    "per seed",
    "not measured",
)


def statistics_rows(comparisons: Sequence[GroupComparison]) -> list[tuple[str, ...]]:
    """One row per measure and comparison, the cells as both the terminal and the page show
    them (:data:`STATISTICS_HEADER`)."""
    return [
        (f"{c.other} vs {c.reference}", *_cells(stat)) for c in comparisons for stat in c.statistics
    ]


def _cells(stat: PairedStatistic) -> tuple[str, ...]:
    fmt = "{:.4g}".format
    centre = "—" if stat.centre is None else fmt(stat.centre)
    if stat.kind == RATIO and stat.centre is not None:
        centre += " (geometric mean)"
    interval = "—" if stat.low is None else f"[{fmt(stat.low)}, {fmt(stat.high)}]"
    p = "—" if stat.p_value is None else f"{stat.p_value:.3g}"
    total = len(stat.values) + len(stat.missing)
    if stat.kind == VALUE:
        agree = f"{stat.agree} of {total} have one"
    else:
        agree = f"{stat.agree} of {len(stat.values)}"
    seeds = ", ".join(f"{s}: {fmt(v)}" for s, v in zip(stat.seeds, stat.values)) or "—"
    return (stat.measure, centre, interval, stat.method, p, agree, seeds, "; ".join(stat.missing))


def groups_json(groups: Sequence[Group], comparisons: Sequence[GroupComparison]) -> dict[str, Any]:
    """What ``dynamics compare --json`` prints: the groups' runs by seed and every statistic."""
    return {
        "reference": groups[0].name,
        "groups": {
            g.name: {str(seed): str(run.path) for seed, run in g.runs.items()} for g in groups
        },
        "comparisons": [
            {
                "reference": c.reference,
                "other": c.other,
                "statistics": [stat.to_dict() for stat in c.statistics],
            }
            for c in comparisons
        ],
    }


def write_group_comparison(
    groups: Sequence[Group],
    comparisons: Sequence[GroupComparison] | None,
    out_path: str | os.PathLike,
    overwrite: bool = False,
    *,
    static_dir: str | os.PathLike | None = None,
    static_format: str = "png",
) -> Written:
    """Write the grouped comparison page: statistics, groups, per-seed comparability, bands.

    Args:
        groups: the groups (:func:`~dynamics.analysis.groups.load_groups`); the first is the
            reference.
        comparisons: their :func:`~dynamics.analysis.groups.compare_groups`, or None to
            compute them.
        out_path: the HTML file to write (atomically).
        overwrite: replace an existing output.
        static_dir: also export every figure into this folder.
        static_format: ``"png"`` or ``"svg"``.

    Raises:
        DynamicsError: an output that cannot be written or is one of the inputs.
    """
    inputs = [run.path for group in groups for run in group.runs.values()]
    out = check_output(out_path, overwrite, inputs)
    if comparisons is None:
        comparisons = compare_groups(groups)
    figures = _band_figures(groups)
    reference = groups[0]
    pairs = [
        (
            f"{group.name} vs {reference.name}, seed {seed}",
            verdict(comparability(run, reference.runs[seed], (group.name, reference.name))),
        )
        for group in groups[1:]
        for seed, run in group.runs.items()
    ]
    body = [
        "<h1>dynamics grouped comparison</h1>",
        f"<p class='meta'>reference group: {html.escape(reference.name)} · "
        f"dynamics {__version__}</p>",
        "<h2>Paired statistics across seeds</h2>",
        html_table(STATISTICS_HEADER, statistics_rows(comparisons)),
        f"<p class='note'>{html.escape(STATISTICS_NOTE)}</p>",
        "<h2>Groups</h2>",
        html_table(
            ("group", "seeds", "run files"),
            [
                (
                    g.name,
                    ", ".join(map(str, g.seeds)),
                    ", ".join(str(r.path) for r in g.runs.values()),
                )
                for g in groups
            ],
        ),
        "<h2>Comparability, seed by seed</h2>",
        html_table(("pair", "verdict"), pairs),
        "<h2>Bands over seeds</h2>",
        f"<p class='note'>{html.escape(BAND_NOTE)}</p>",
    ]
    body += [figure_html(figure, i) for i, (_, figure) in enumerate(figures)]
    title = "dynamics grouped comparison: " + " vs ".join(g.name for g in groups)
    return write_page(
        out, html_page(title, "".join(body)), figures, static_dir, static_format, overwrite
    )


#: What the statistics table's columns mean, under the table on the page and the terminal.
STATISTICS_NOTE = (
    "Runs pair by seed. Losses are the smoothed held-out loss (the training loss when a run "
    "lacks two held-out values); 'overtakes' is the step where the other group takes the lead "
    "for good; the λ1 ratio is the median over time of λ1(other) / λ1(reference). Interval: "
    "with ≤5 seeds the range of the per-seed values, an exact distribution-free interval for "
    "their median (confidence 1 − 2^(1−n)); with more, a 95% BCa bootstrap of the mean "
    "(scipy.stats.bootstrap on the paired values, fixed seed). Sign test: exact two-sided "
    "binomial test against no difference (0, or 1 for a ratio)."
)
BAND_NOTE = "Lines: mean over seeds; bands: min–max over seeds (not a confidence interval)."


def _band_figures(groups: Sequence[Group]) -> list[tuple[str, go.Figure]]:
    figures = []
    for key, title, y_title, read, log_y in _BANDS:
        figure = go.Figure()
        drawn = False
        for group, color in zip(groups, run_colors(len(groups))):
            band = _band([read(run) for run in group.runs.values()])
            if band is None:
                continue
            drawn = True
            _add_band(figure, group.name, color, *band)
        if drawn:
            figure.update_layout(title=title, height=420, template="plotly_white")
            figure.update_xaxes(title_text="step")
            drawn_values = [trace.y for trace in figure.data if trace.y is not None]
            figure.update_yaxes(title_text=y_title, **y_scale(log_y, *drawn_values))
            figures.append((key, figure))
    return figures


_BANDS: tuple[tuple[str, str, str, Callable[[Run], Metric | None], bool], ...] = (
    ("train-loss", "Training loss over seeds", "loss", Run.train_loss, True),
    ("heldout-loss", "Held-out loss over seeds", "held-out loss", Run.heldout_loss, True),
    ("top-eigenvalue", "Top Hessian eigenvalue λ1 over seeds", "λ1", top_eigenvalue, True),
)


def _band(metrics: list[Metric | None]) -> tuple[np.ndarray, ...] | None:
    """``(steps, mean, low, high)`` over the seeds' series, or None unless every seed has
    at least two finite records that overlap."""
    if any(m is None for m in metrics):
        return None
    series = [finite(m.step, m.values) for m in metrics]
    if any(len(values) < 2 for _, values in series):
        return None
    steps = series[0][0].astype(float)
    start = max(s[0] for s, _ in series)
    end = min(s[-1] for s, _ in series)
    steps = steps[(steps >= start) & (steps <= end)]
    if len(steps) < 2:
        return None
    table = np.stack([np.interp(steps, s, v) for s, v in series])
    return steps, table.mean(0), table.min(0), table.max(0)


def _add_band(
    figure: go.Figure,
    name: str,
    color: str,
    steps: np.ndarray,
    mean: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
) -> None:
    figure.add_trace(
        go.Scatter(
            x=np.concatenate([steps, steps[::-1]]),
            y=np.concatenate([high, low[::-1]]),
            fill="toself",
            fillcolor=color,
            opacity=0.2,
            line={"color": color, "width": 0.5},
            name=f"{name} min–max",
            legendgroup=name,
            hoverinfo="skip",
        )
    )
    figure.add_trace(
        go.Scatter(x=steps, y=mean, name=f"{name} mean", line={"color": color}, legendgroup=name)
    )
