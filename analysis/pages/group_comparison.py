"""Grouped comparison over seeds: the paired statistics as a table (the terminal and the page
print the same rows) and as one HTML page with bands instead of one line per run
(:mod:`dynamics.analysis.figures.seed_bands`). The numbers, and their JSON, come from
:mod:`dynamics.analysis.measures.seed_groups`.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence

from dynamics import __version__
from dynamics.analysis.figures.seed_bands import seed_band_figures
from dynamics.analysis.measures.paired_statistics import RATIO, VALUE, PairedStatistic
from dynamics.analysis.measures.run_comparison import comparability, verdict
from dynamics.analysis.measures.seed_groups import Group, GroupComparison, compare_groups
from dynamics.analysis.output import check_output
from dynamics.analysis.pages.page import Written, figure_html, html_page, html_table, write_page

__all__ = ["STATISTICS_HEADER", "statistics_rows", "write_group_comparison"]

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
    them (:data:`STATISTICS_HEADER`).

    Example::

        for row in statistics_rows(compare_groups(groups)):
            print(" | ".join(row))
    """
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
        groups: the groups (:func:`~dynamics.analysis.measures.seed_groups.load_groups`);
            the first is the reference.
        comparisons: their :func:`~dynamics.analysis.measures.seed_groups.compare_groups`,
            or None to compute them.
        out_path: the HTML file to write (atomically).
        overwrite: replace an existing output.
        static_dir: also export every figure into this folder.
        static_format: ``"png"`` or ``"svg"``.

    Raises:
        DynamicsError: an output that cannot be written or is one of the inputs.

    Example::

        groups = load_groups([("base", "runs/base"), ("shifted", "runs/shifted")])
        write_group_comparison(groups, None, "runs/groups.html")
    """
    inputs = [run.path for group in groups for run in group.runs.values()]
    out = check_output(out_path, overwrite, inputs)
    if comparisons is None:
        comparisons = compare_groups(groups)
    figures = seed_band_figures(groups)
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
