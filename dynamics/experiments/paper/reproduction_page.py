"""The reproduction report: the paper's claims, the criteria of their verdicts (printed before
any number), and each claim's figure over seeds with its verdict, as one HTML page, a JSON file
beside it, and the rows the terminal prints.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dynamics import __version__
from dynamics.analysis.figures import run_colors
from dynamics.analysis.measures.paired_statistics import RATIO
from dynamics.analysis.output import write_atomically
from dynamics.analysis.pages.page import Written, figure_html, html_page, html_table, write_page
from dynamics.experiments.paper.claims import REPRODUCED, VERDICT_RULE, ClaimResult
from dynamics.experiments.paper.sensitivity import (
    EXPERIMENT,
    SENSITIVITY,
    Setup,
    SetupResult,
    reading_statements,
)
from dynamics.experiments.paper.sensitivity_page import sensitivity_section

__all__ = ["CLAIMS_HEADER", "ExperimentRecord", "claim_rows", "write_reproduction"]

CLAIMS_HEADER = (
    "claim",
    "experiment",
    "figure",
    "centre",
    "interval",
    "seeds meeting criterion",
    "verdict",
)


@dataclass(frozen=True)
class ExperimentRecord:
    """One experiment of the reproduction: how it was run and where its comparison is.

    Attributes:
        key: the experiment (``teacher_student``).
        config: the config file it was run from.
        command: the ``dynamics run`` command that trains the same runs.
        seeds: the seeds.
        steps: optimizer steps per run (None: not run).
        status: ``"run"``, ``"not run (...)"`` or ``"failed: ..."``.
        comparison: the grouped comparison page, relative to the report, or None.
        wall_s: seconds its runs and comparison took.
    """

    key: str
    config: str
    command: str
    seeds: tuple[int, ...]
    steps: int | None
    status: str
    comparison: str | None = None
    wall_s: float | None = None


def claim_rows(results: Sequence[ClaimResult]) -> list[tuple[str, ...]]:
    """One row per claim, as the terminal and the page show them (:data:`CLAIMS_HEADER`)."""
    rows = []
    for result in results:
        stat = result.statistic
        centre = interval = meeting = "—"
        if stat is not None and stat.centre is not None:
            centre = f"{stat.centre:.4g}" + (" (geometric mean)" if stat.kind == RATIO else "")
        if stat is not None and stat.low is not None:
            interval = f"[{stat.low:.4g}, {stat.high:.4g}]"
        if stat is not None:
            meeting = f"{result.holds} of {len(stat.values) + len(stat.missing)}"
        rows.append(
            (
                result.claim.key,
                result.claim.experiment,
                result.claim.figure,
                centre,
                interval,
                meeting,
                result.verdict + (f" ({result.reason})" if result.reason else ""),
            )
        )
    return rows


def write_reproduction(
    results: Sequence[ClaimResult],
    experiments: Sequence[ExperimentRecord],
    out: Path,
    *,
    command: str,
    mode: str,
    wall_s: float,
    sensitivity: Sequence[SetupResult] = (),
    sensitivity_unmeasured: Sequence[str] = (),
) -> tuple[Written, Path]:
    """Write the report to ``out`` (HTML, already checked) and its JSON beside it
    (``out`` with suffix ``.json``); returns what was written and the JSON's path.

    ``sensitivity`` holds the setups measured for the sensitivity section, each linked to its
    grouped comparison at ``sensitivity/<setup>/compare.html`` (the controlled experiment's for
    the default setup); ``sensitivity_unmeasured`` one line per setup that was not.

    Example::

        written, summary = write_reproduction(
            results, records, Path("runs/reproduce/reproduce.html"),
            command="dynamics reproduce --quick", mode="quick", wall_s=312.0,
        )
    """
    figures = [("claims", _claims_figure(results))] if _measured(results) else []
    body = [
        "<h1>dynamics: reproduction of seed 002's claims</h1>",
        f"<p class='meta'>{html.escape(mode)} · command <code>{html.escape(command)}</code> · "
        f"wall time {_duration(wall_s)} · dynamics {__version__}</p>",
        "<h2>How each verdict is decided (fixed before the runs)</h2>",
        f"<p>{html.escape(VERDICT_RULE)}</p>",
        html_table(
            ("claim", "experiment", "the paper says", "per-seed figure", "criterion", "weaker"),
            [
                (
                    r.claim.key,
                    r.claim.experiment,
                    r.claim.statement,
                    r.claim.figure,
                    r.claim.criterion,
                    r.claim.weaker or "—",
                )
                for r in results
            ],
        ),
        "<h2>Claims, measured</h2>",
        _results_table(results, {e.key: e for e in experiments}),
        "<p class='note'>Centre: mean over seeds (geometric mean for a ratio). Interval: with ≤5 "
        "seeds the range of the per-seed values, an exact distribution-free interval for their "
        "median (confidence 1 − 2^(1−n)); with more, a 95% BCa bootstrap of the mean.</p>",
        "<h2>Experiments</h2>",
        _experiments_table(experiments),
    ]
    if figures:
        body += [
            "<h2>Per-seed figures</h2>",
            "<p class='note'>Each claim's figure, one point per seed; the dashed line is its "
            "criterion's bound.</p>",
            figure_html(figures[0][1], 0),
        ]
    if sensitivity or sensitivity_unmeasured:
        links = {r.setup.key: _comparison_of(r.setup, experiments) for r in sensitivity}
        section, figure = sensitivity_section(sensitivity, links, len(figures))
        if figure is not None:
            figures.append(("sensitivity", figure))
        unmeasured = "".join(f"<li>{html.escape(line)}</li>" for line in sensitivity_unmeasured)
        body += [section, f"<p>Not measured:</p><ul>{unmeasured}</ul>" if unmeasured else ""]
    written = write_page(out, html_page("dynamics reproduction", "".join(body)), figures)
    data = {
        "mode": mode,
        "command": command,
        "wall_s": wall_s,
        "verdict_rule": VERDICT_RULE,
        "experiments": [asdict(e) for e in experiments],
        "claims": [r.to_dict() for r in results],
        "sensitivity": {
            "setups": [r.to_dict() for r in sensitivity],
            "statements": reading_statements(sensitivity),
            "not_measured": list(sensitivity_unmeasured),
        },
    }
    json_path = out.with_suffix(".json")
    write_atomically(json_path, json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
    return written, json_path


def _results_table(results: Sequence[ClaimResult], experiments: dict[str, Any]) -> str:
    head = "".join(
        f"<th>{html.escape(h)}</th>"
        for h in (*CLAIMS_HEADER, "per seed", "config and command", "comparison")
    )
    rows = []
    for result, row in zip(results, claim_rows(results)):
        stat = result.statistic
        seeds = "—"
        if stat is not None:
            seeds = ", ".join(
                f"{s}: {v:.4g}" + (f" ({result.details[s]})" if s in result.details else "")
                for s, v in zip(stat.seeds, stat.values)
            )
            seeds = "; ".join(filter(None, [seeds, *stat.missing])) or "—"
        record = experiments.get(result.claim.experiment)
        how = "—" if record is None else f"{record.config}: {record.command}"
        link = "—"
        if record is not None and record.comparison:
            href = html.escape(record.comparison, quote=True)
            link = f"<a href='{href}'>{html.escape(record.comparison)}</a>"
        cells = "".join(f"<td>{html.escape(c)}</td>" for c in (*row, seeds, how))
        css = " class='flag'" if result.verdict != REPRODUCED else ""
        rows.append(f"<tr{css} id='{result.claim.key}'>{cells}<td>{link}</td></tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _comparison_of(setup: Setup, experiments: Sequence[ExperimentRecord]) -> str:
    """The grouped comparison page of a setup's runs, or "—"."""
    key = f"{SENSITIVITY}/{setup.key}" if setup.overrides else EXPERIMENT
    record = next((e for e in experiments if e.key == key), None)
    return record.comparison if record is not None and record.comparison else "—"


def _experiments_table(experiments: Sequence[ExperimentRecord]) -> str:
    return html_table(
        ("experiment", "config", "seeds", "steps", "status", "wall time", "command"),
        [
            (
                e.key,
                e.config,
                ", ".join(map(str, e.seeds)),
                "—" if e.steps is None else str(e.steps),
                e.status,
                "—" if e.wall_s is None else _duration(e.wall_s),
                e.command,
            )
            for e in experiments
        ],
    )


def _measured(results: Sequence[ClaimResult]) -> list[ClaimResult]:
    return [r for r in results if r.statistic is not None and r.statistic.values]


def _claims_figure(results: Sequence[ClaimResult]) -> go.Figure:
    measured = _measured(results)
    figure = make_subplots(
        rows=len(measured),
        cols=1,
        subplot_titles=[f"{r.claim.key}: {r.claim.figure}" for r in measured],
        vertical_spacing=min(0.08, 0.5 / len(measured)),
    )
    colors = run_colors(len(measured))
    for i, (result, color) in enumerate(zip(measured, colors), 1):
        stat = result.statistic
        figure.add_trace(
            go.Scatter(
                x=list(stat.values),
                y=[result.claim.key] * len(stat.values),
                mode="markers",
                marker={"color": color, "size": 9},
                text=[f"seed {s}" for s in stat.seeds],
                name=result.claim.key,
                showlegend=False,
            ),
            row=i,
            col=1,
        )
        for bound in result.claim.bounds:
            figure.add_vline(x=bound, line_dash="dash", line_color="#888", row=i, col=1)
    figure.update_layout(
        height=max(300, 110 * len(measured)), template="plotly_white", title="Per-seed figures"
    )
    return figure


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"
