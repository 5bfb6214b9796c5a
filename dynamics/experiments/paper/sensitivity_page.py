"""The reproduction page's sensitivity section: the teacher–student claims' verdicts over the
preset setups, which orthogonality reading holds in which setup, and the readings over time
(:mod:`dynamics.experiments.paper.sensitivity`); and the rows the terminal prints."""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dynamics.analysis.figures import run_colors
from dynamics.analysis.pages.page import figure_html, html_table
from dynamics.experiments.paper.claims import ORTHOGONAL_COSINE, ClaimResult
from dynamics.experiments.paper.sensitivity import READINGS, SetupResult, reading_statements

__all__ = ["sensitivity_figure", "sensitivity_rows", "sensitivity_section"]


def sensitivity_rows(results: Sequence[SetupResult]) -> tuple[tuple[str, ...], list[list[str]]]:
    """The verdict table: one row per setup, one column per claim (verdict and centre)."""
    claims = [r.claim.key for r in results[0].claims] if results else []
    header = ("setup", "trained with", "seeds", *claims)
    rows = [
        [
            result.setup.label,
            result.trained,
            str(len(result.seeds)),
            *map(_verdict_cell, result.claims),
        ]
        for result in results
    ]
    return header, rows


def sensitivity_section(
    results: Sequence[SetupResult], links: dict[str, str], figure_index: int
) -> tuple[str, go.Figure | None]:
    """The section's HTML and its figure (drawn at ``figure-<figure_index>``), or None.

    Args:
        results: one per setup that ran.
        links: each setup's grouped comparison page by setup key, relative to the page.
    """
    header, rows = sensitivity_rows(results)
    linked = [(*row, links.get(r.setup.key, "—")) for r, row in zip(results, rows, strict=True)]
    parts = [
        "<h2 id='sensitivity'>Sensitivity to the setup</h2>",
        "<p>Seed 002 states neither the optimizer nor the learning rate of the controlled "
        "experiment, so the same comparison is run in each setup below and every teacher–"
        "student claim is decided by the same criteria. The null pair shifts the 'shifted' "
        "student by 0.01 only: its verdicts are what the setup alone does to two students "
        "that barely differ, not the shift's effect.</p>",
        _linked_table((*header, "comparison"), linked),
        "<h3>Which reading of the orthogonality claim holds</h3>",
        f"<p>A reading holds for a seed when its |cos| is below {ORTHOGONAL_COSINE} (the "
        "orthogonal claim's criterion): at the last stored step, and at every stored step of "
        "the run's second half.</p>",
        "<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in reading_statements(results)),
        "</ul>",
        html_table(
            (
                "setup",
                "reading",
                "seeds holding at the end",
                "over the second half",
                "final angle per seed",
            ),
            [
                (
                    r.setup.label,
                    READINGS[key],
                    f"{p.holds_at_end()} of {len(p.cosines)}",
                    f"{p.holds_over_last_half()} of {len(p.cosines)}",
                    ", ".join(
                        f"{s}: {a:.1f}°" for s, a in zip(sorted(p.cosines), p.angles_deg()[:, -1])
                    ),
                )
                for r in results
                for key, p in r.readings.items()
            ],
        ),
    ]
    remarks = [f"{r.setup.label}: {line}" for r in results for line in r.remarks]
    if remarks:
        parts.append("<p class='note'>" + html.escape("; ".join(remarks)) + "</p>")
    figure = sensitivity_figure(results)
    if figure is not None:
        parts += [
            "<p class='note'>Each reading's angle over training (mean over seeds, band: "
            "min–max), and both students' in-plane shares of ‖θt − θ0‖².</p>",
            figure_html(figure, figure_index),
        ]
    return "".join(parts), figure


def sensitivity_figure(results: Sequence[SetupResult]) -> go.Figure | None:
    """Per setup (rows): the readings' angles over time (left), the in-plane shares (right)."""
    drawn = [r for r in results if r.readings]
    if not drawn:
        return None
    figure = make_subplots(
        rows=len(drawn),
        cols=2,
        subplot_titles=[t for r in drawn for t in (f"{r.setup.label}: angles", "in-plane shares")],
        vertical_spacing=min(0.08, 0.5 / len(drawn)),
    )
    colors = dict(zip(READINGS, run_colors(len(READINGS))))
    share_colors = run_colors(2)
    for row, result in enumerate(drawn, 1):
        for key, profile in result.readings.items():
            _band(
                figure,
                profile.steps,
                profile.angles_deg(),
                READINGS[key],
                colors[key],
                row,
                1,
                legend=row == 1,
            )
        if result.shares is not None:
            steps, per_seed = result.shares
            for i, student in enumerate(("unshifted", "shifted")):
                values = np.vstack([pair[i] for pair in per_seed.values()])
                _band(
                    figure,
                    steps,
                    values,
                    f"{student} student's share",
                    share_colors[i],
                    row,
                    2,
                    legend=row == 1,
                )
        figure.update_yaxes(title_text="angle (°)", range=[0, 180], row=row, col=1)
        figure.update_yaxes(title_text="share", range=[0, 1.05], row=row, col=2)
    figure.update_xaxes(title_text="step", row=len(drawn))
    figure.update_layout(
        height=max(320, 260 * len(drawn)),
        template="plotly_white",
        title="Orthogonality readings over training, per setup",
    )
    return figure


def _band(
    figure: go.Figure,
    steps: np.ndarray,
    values: np.ndarray,
    name: str,
    color: str,
    row: int,
    col: int,
    legend: bool,
) -> None:
    """The mean over seeds (rows of ``values``) as a line and their min–max as a band."""
    with np.errstate(invalid="ignore"):
        mean, low, high = (f(values, axis=0) for f in (np.nanmean, np.nanmin, np.nanmax))
    x = steps.tolist()
    figure.add_trace(
        go.Scatter(
            x=x + x[::-1],
            y=np.concatenate([high, low[::-1]]).tolist(),
            fill="toself",
            fillcolor=color,
            opacity=0.15,
            line={"width": 0},
            hoverinfo="skip",
            showlegend=False,
            legendgroup=name,
        ),
        row=row,
        col=col,
    )
    figure.add_trace(
        go.Scatter(
            x=x,
            y=mean.tolist(),
            name=name,
            line={"color": color},
            legendgroup=name,
            showlegend=legend,
        ),
        row=row,
        col=col,
    )


def _verdict_cell(result: ClaimResult) -> str:
    stat = result.statistic
    if stat is None or stat.centre is None:
        return result.verdict
    return f"{result.verdict} ({stat.centre:.3g})"


def _linked_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table whose last column is a link (a relative path) or "—"."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for *cells, link in rows:
        tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        href = html.escape(link, quote=True)
        anchor = "—" if link == "—" else f"<a href='{href}'>{html.escape(link)}</a>"
        body.append(f"<tr>{tds}<td>{anchor}</td></tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
