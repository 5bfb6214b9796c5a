"""The sweep page: each claim's figure and verdict over the cells of a grid, as a table with a
link to each cell's grouped comparison and, over one or two grid keys, a chart (a heatmap with
one axis per key, or bars over one key), then every cell's paired statistics.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from dynamics import __version__
from dynamics.analysis.output import check_output
from dynamics.analysis.pages.group_comparison import (
    STATISTICS_HEADER,
    STATISTICS_NOTE,
    statistics_rows,
)
from dynamics.analysis.pages.page import Written, figure_html, html_page, html_table, write_page
from dynamics.experiments.paper.claims import REPRODUCED
from dynamics.experiments.paper.reproduction_page import claim_rows

#: A sweep's cell result (:class:`dynamics.experiments.sweep.CellResult`), which this module
#: may not import: the sweep imports the claims and this page from the paper, not the reverse.
CellResult = Any

__all__ = ["CELL_CLAIM_HEADER", "cell_claim_rows", "write_sweep_page"]

#: The columns of a claim's table over the cells (the terminal's and the page's).
CELL_CLAIM_HEADER = ("cell", "status", "centre", "interval", "seeds meeting criterion", "verdict")


def cell_claim_rows(results: Sequence[CellResult], key: str) -> list[tuple[str, ...]]:
    """Per cell, the claim ``key``'s figure and verdict (:data:`CELL_CLAIM_HEADER`); a failed
    cell's verdict is its one-line error."""
    rows = []
    for result in results:
        claim = next((c for c in result.claims if c.claim.key == key), None)
        if claim is None:
            verdict = f"failed: {result.error}" if result.error else "not measured"
            rows.append((result.cell.name, result.status, "—", "—", "—", verdict))
        else:
            rows.append((result.cell.name, result.status, *claim_rows([claim])[0][3:]))
    return rows


def write_sweep_page(data: dict[str, Any], results: Sequence[CellResult], out: Path) -> Written:
    """Write the page of a sweep (``data``: its ``sweep.json``; ``results``: its cells) to
    ``out``, atomically.

    Example::

        sweep = run_cells("teacher_student", cells, "runs/sweep", seeds=[0, 1, 2])
        write_sweep_page(sweep.data, sweep.cells, sweep.page_path)  # run_cells does this too
    """
    out = check_output(out, True)
    grid = data["grid"]
    figures = []
    body = [
        "<h1>dynamics sweep</h1>",
        f"<p class='meta'>{html.escape(data['experiment'])} from "
        f"<code>{html.escape(data['config'])}</code> · seeds "
        f"{', '.join(map(str, data['seeds']))} · {len(results)} cells · command "
        f"<code>{html.escape(data['command'] or '—')}</code> · wall time "
        f"{data['wall_s']:.1f} s · dynamics {__version__}</p>",
        html_table(("grid key", "values"), [(k, ", ".join(map(str, v))) for k, v in grid.items()]),
        html_table(
            ("shared setting", "value"), [(k, str(v)) for k, v in data["base_overrides"].items()]
        )
        if data["base_overrides"]
        else "",
        "<h2>How each verdict is decided (fixed before the runs)</h2>",
        f"<p>{html.escape(data['verdict_rule'])}</p>",
    ]
    failed = [r for r in results if r.error]
    if failed:
        body += [
            "<h2>Failed cells</h2>",
            html_table(("cell", "error"), [(r.cell.name, r.error) for r in failed], ["flag"] * 99),
        ]
    for claim in data["claims"]:
        body += [
            f"<h2 id='{html.escape(claim['key'], quote=True)}'>{html.escape(claim['key'])}: "
            f"{html.escape(claim['statement'])}</h2>",
            f"<p class='note'>Per seed: {html.escape(claim['figure'])}. Criterion: "
            f"{html.escape(claim['criterion'])}"
            + (f"; weaker form: {html.escape(claim['weaker'])}" if claim["weaker"] else "")
            + ".</p>",
            _claim_table(results, claim["key"], list(grid)),
        ]
        figure = _claim_figure(results, claim, grid)
        if figure is not None:
            body.append(figure_html(figure, len(figures)))
            figures.append((f"claim-{claim['key']}", figure))
    body += [
        "<h2>Paired statistics, cell by cell</h2>",
        html_table(
            ("cell", *STATISTICS_HEADER),
            [
                (r.cell.name, *row)
                for r in results
                if r.paired
                for row in statistics_rows([r.paired])
            ],
        ),
        f"<p class='note'>{html.escape(STATISTICS_NOTE)}</p>",
    ]
    return write_page(out, html_page("dynamics sweep", "".join(body)), figures)


def _claim_table(results: Sequence[CellResult], key: str, keys: list[str]) -> str:
    head = "".join(
        f"<th>{html.escape(h)}</th>"
        for h in (*CELL_CLAIM_HEADER[:1], *keys, *CELL_CLAIM_HEADER[1:])
    )
    rows = []
    for result, row in zip(results, cell_claim_rows(results, key)):
        name, *rest = row
        link = html.escape(name)
        if result.comparison_page:
            link = f"<a href='{html.escape(result.comparison_page, quote=True)}'>{link}</a>"
        values = [str(result.cell.overrides.get(k, "—")) for k in keys]
        cells = "".join(f"<td>{html.escape(c)}</td>" for c in (*values, *rest))
        flag = " class='flag'" if rest[-1] != REPRODUCED else ""
        rows.append(f"<tr{flag}><td>{link}</td>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _centre(result: CellResult, key: str) -> tuple[float | None, str]:
    claim = next((c for c in result.claims if c.claim.key == key), None)
    if claim is None:
        return None, "failed" if result.error else "not measured"
    centre = None if claim.statistic is None else claim.statistic.centre
    return centre, claim.verdict


def _bound(results: Sequence[CellResult], key: str) -> float | None:
    for result in results:
        for measured in result.claims:
            if measured.claim.key == key and len(measured.claim.bounds) == 1:
                return measured.claim.bounds[0]
    return None


def _claim_figure(
    results: Sequence[CellResult], claim: dict[str, Any], grid: dict[str, list[Any]]
) -> go.Figure | None:
    """A heatmap over two grid keys, bars over one; None over more (the table shows them)."""
    keys = list(grid)
    if not 1 <= len(keys) <= 2 or not any(_centre(r, claim["key"])[0] is not None for r in results):
        return None
    title = f"{claim['key']}: {claim['figure']}"
    if len(keys) == 1:
        (key,) = keys
        x, y, text = [], [], []
        for result in results:
            centre, verdict = _centre(result, claim["key"])
            x.append(str(result.cell.overrides.get(key)))
            y.append(centre)
            text.append(verdict)
        figure = go.Figure(go.Bar(x=x, y=y, text=text, textposition="outside", name=claim["key"]))
        figure.update_layout(xaxis_title=key, yaxis_title="centre over seeds")
    else:
        rows, columns = ([str(v) for v in grid[k]] for k in keys)
        z: list[list[float | None]] = [[None] * len(columns) for _ in rows]
        text = [[""] * len(columns) for _ in rows]
        for result in results:
            centre, verdict = _centre(result, claim["key"])
            row = rows.index(str(result.cell.overrides.get(keys[0])))
            column = columns.index(str(result.cell.overrides.get(keys[1])))
            z[row][column] = centre
            text[row][column] = verdict if centre is None else f"{centre:.3g}<br>{verdict}"
        figure = go.Figure(
            go.Heatmap(
                z=z,
                x=columns,
                y=rows,
                text=text,
                texttemplate="%{text}",
                colorscale="RdBu",
                # One bound (the criterion's threshold): the colours part on either side of it.
                zmid=_bound(results, claim["key"]),
                colorbar={"title": {"text": "centre"}},
                hovertemplate=f"{keys[0]}=%{{y}}<br>{keys[1]}=%{{x}}<br>%{{text}}<extra></extra>",
            )
        )
        figure.update_layout(
            xaxis={"title": keys[1], "type": "category"},
            yaxis={"title": keys[0], "type": "category"},
        )
    figure.update_layout(title=title, height=420, template="plotly_white")
    return figure
