"""Side-by-side comparison of runs: overlays, crossover, curvature ratio, comparability checks.

The first run is the reference; every other run is compared with it. Series are aligned by
optimizer step: the other run is read at the reference's recorded steps inside the range both
cover, linearly interpolated between its own records (exact where the schedules agree, as they
do for runs of one config).

Losses are compared after a centred moving average over ``2h + 1`` records with
``h = round(SMOOTH_FRACTION * n)`` (no smoothing for short series such as a handful of held-out
evaluations), so that step noise in the training loss does not produce spurious crossovers.

A comparison is only meaningful when the runs differ in the named variant alone: the page
carries a warning row when θ0 (its recorded hash), the data section of the config, or any other
config key except ``variant``, ``shift`` and ``run_name`` differ.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import plotly.graph_objects as go
from numpy.typing import ArrayLike

from dynamics import __version__
from dynamics.analysis.figures import (
    Curve,
    layer_figure,
    line_figure,
    panels_figure,
    run_colors,
)
from dynamics.analysis.output import check_output
from dynamics.analysis.overshoot import OvershootReport
from dynamics.analysis.report import (
    Written,
    figure_html,
    finish,
    heldout_loss,
    html_page,
    html_table,
    open_runs,
    overshoot_html,
    run_overshoot,
    series,
    train_loss,
)
from dynamics.analysis.smoothing import moving_average
from dynamics.errors import DynamicsError
from dynamics.store import Run

__all__ = [
    "IGNORED_CONFIG_KEYS",
    "SMOOTH_FRACTION",
    "Crossover",
    "align",
    "config_differences",
    "crossover",
    "smooth",
    "write_comparison",
]

#: Smoothing half-width as a fraction of a loss series' records: about 4% of the run per window,
#: the scale the overshoot detector smooths on as well.
SMOOTH_FRACTION = 0.02
#: Config keys (at any depth) that name the variant rather than change the experiment.
IGNORED_CONFIG_KEYS = frozenset({"variant", "shift", "run_name"})


@dataclass(frozen=True)
class Crossover:
    """Which of two runs ends ahead on a loss, and from which step on.

    Attributes:
        metric: the loss compared (``"held-out loss (val_loss)"`` or ``"train loss"``).
        first_leader: the run with the lower smoothed loss at the first aligned step, or None
            on a tie.
        winner: the run with the lower smoothed loss at the last aligned step, or None on a tie.
        step: the step where the winner overtook for good (linear interpolation of where the
            smoothed difference crosses zero), or None when it led at every aligned step.
        final_gap: the loser's final smoothed loss minus the winner's (>= 0).
        final_gap_relative: ``final_gap`` over the loser's final smoothed loss.
    """

    metric: str
    first_leader: str | None
    winner: str | None
    step: float | None
    final_gap: float
    final_gap_relative: float


def write_comparison(
    run_paths: Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    overwrite: bool = False,
    *,
    static_dir: str | os.PathLike | None = None,
    static_format: str = "png",
) -> Written:
    """Write one self-contained HTML page comparing runs with the first one.

    Args:
        run_paths: two or more run files; the first is the reference.
        out_path: the HTML file to write (atomically).
        overwrite: replace an existing ``out_path`` (and existing static files).
        static_dir: also export every figure into this folder (see
            :func:`dynamics.analysis.report.write_report`).
        static_format: ``"png"`` or ``"svg"``.

    Returns:
        What was written.

    Raises:
        DynamicsError: fewer than two runs, a file that is not a readable run file, a run
            without a training or held-out loss, an output in a missing or unwritable folder,
            an existing output without ``overwrite``, or an output that is one of the inputs.
            Nothing is written then.
    """
    if len(run_paths) < 2:
        raise DynamicsError("compare needs at least two run files")
    out = check_output(out_path, overwrite, run_paths)
    runs = open_runs(run_paths)
    for run in runs:
        if train_loss(run) is None and heldout_loss(run) is None:
            raise DynamicsError(f"{run.path}: no training or held-out loss series to compare")
    labels = _labels(runs)
    overshoots = [run_overshoot(run) for run in runs]
    figures = _figures(runs, labels)
    body = [
        "<h1>dynamics comparison</h1>",
        f"<p class='meta'>reference: {html.escape(labels[0])} · dynamics {__version__}</p>",
        "<h2>Summary</h2>",
        _summary_html(runs, labels, overshoots),
        "<h2>Comparability</h2>",
        _comparability_html(runs, labels),
        "<h2>Overlaid</h2>",
    ]
    body += [figure_html(figure, i) for i, (_, figure) in enumerate(figures)]
    body.append("<h2>Overshoot verdicts</h2>")
    for label, report in zip(labels, overshoots):
        body.append(f"<h3>{html.escape(label)}</h3>{overshoot_html(report)}")
    body.append("<h2>Config</h2>" + _config_html(runs, labels))
    page = html_page("dynamics comparison: " + " vs ".join(labels), "".join(body))
    return finish(out, page, figures, static_dir, static_format, overwrite)


def smooth(values: ArrayLike, fraction: float = SMOOTH_FRACTION) -> np.ndarray:
    """:func:`moving_average` with a half-width of ``round(fraction * n)`` records."""
    x = np.asarray(values, dtype=float)
    return moving_average(x, round(fraction * len(x)))


def align(
    step_a: ArrayLike, a: ArrayLike, step_b: ArrayLike, b: ArrayLike
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read series ``b`` at the steps of ``a`` that lie inside ``b``'s range.

    Returns:
        ``(steps, a at steps, b interpolated at steps)``; empty when the ranges do not meet.
    """
    step_a, a = np.asarray(step_a, dtype=float), np.asarray(a, dtype=float)
    step_b, b = np.asarray(step_b, dtype=float), np.asarray(b, dtype=float)
    if not len(step_a) or not len(step_b):
        return np.empty(0), np.empty(0), np.empty(0)
    inside = (step_a >= step_b[0]) & (step_a <= step_b[-1])
    steps = step_a[inside]
    return steps, a[inside], np.interp(steps, step_b, b)


def crossover(
    step_a: ArrayLike,
    loss_a: ArrayLike,
    step_b: ArrayLike,
    loss_b: ArrayLike,
    names: tuple[str, str] = ("a", "b"),
    metric: str = "loss",
    fraction: float = SMOOTH_FRACTION,
) -> Crossover | None:
    """Where the run that ends ahead on a loss took the lead for good.

    Non-finite records are dropped, each loss is smoothed (:func:`smooth`), and ``b`` is read
    at ``a``'s steps (:func:`align`).

    Args:
        step_a: steps of run a's loss.
        loss_a: run a's loss.
        step_b: steps of run b's loss.
        loss_b: run b's loss.
        names: the two runs' names, as the result names them.
        metric: what the loss is, as the result names it.
        fraction: smoothing half-width as a fraction of each series' records.

    Returns:
        The crossover, or None when fewer than two aligned steps remain.
    """
    sa, a = _finite(step_a, loss_a)
    sb, b = _finite(step_b, loss_b)
    steps, a, b = align(sa, smooth(a, fraction), sb, smooth(b, fraction))
    if len(steps) < 2:
        return None
    gap = a - b  # positive where b is lower, i.e. ahead
    sign = np.sign(gap)

    def leader(s: float) -> str | None:
        return None if s == 0 else names[1] if s > 0 else names[0]

    final = sign[-1]
    behind = np.flatnonzero(sign != final)
    step = None
    if final != 0 and behind.size:
        i = behind[-1]  # the winner is strictly ahead from record i + 1 on
        step = float(steps[i] + (steps[i + 1] - steps[i]) * gap[i] / (gap[i] - gap[i + 1]))
    loser_final = max(a[-1], b[-1])
    return Crossover(
        metric=metric,
        first_leader=leader(sign[0]),
        winner=leader(final),
        step=step,
        final_gap=float(abs(gap[-1])),
        final_gap_relative=float(abs(gap[-1]) / loser_final) if loser_final > 0 else float("nan"),
    )


def config_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted config keys whose values differ, ``{key: (value in a, value in b)}``.

    Keys in :data:`IGNORED_CONFIG_KEYS` (at any depth) are left out; a key present in one
    config only differs, with None for the missing side.
    """
    flat_a, flat_b = _flatten(a), _flatten(b)
    return {
        key: (flat_a.get(key), flat_b.get(key))
        for key in sorted(flat_a.keys() | flat_b.keys())
        if key.rsplit(".", 1)[-1] not in IGNORED_CONFIG_KEYS
        and (key not in flat_a or key not in flat_b or flat_a[key] != flat_b[key])
    }


def _pair_losses(
    reference: Run, other: Run
) -> tuple[str, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None:
    """The loss two runs are compared on: held-out when both have two finite values of it
    (it measures what the comparison is about), else training; None when neither is shared."""
    held_ref, held_other = heldout_loss(reference), heldout_loss(other)
    if (
        held_ref
        and held_other
        and min(_finite_count(held_ref[1]), _finite_count(held_other[1])) >= 2
    ):
        return f"held-out loss ({held_ref[2]})", held_ref[:2], held_other[:2]
    train_ref, train_other = train_loss(reference), train_loss(other)
    if train_ref is None or train_other is None:
        return None
    return "train loss", train_ref, train_other


def _pair_crossover(reference: Run, other: Run, names: tuple[str, str]) -> Crossover | None:
    losses = _pair_losses(reference, other)
    if losses is None:
        return None
    metric, (sa, a), (sb, b) = losses
    return crossover(sa, a, sb, b, names, metric)


def _summary_html(
    runs: list[Run], labels: list[str], overshoots: list[OvershootReport | None]
) -> str:
    per_run = []
    for run, report in zip(runs, overshoots):
        train, held = train_loss(run), heldout_loss(run)
        per_run.append(
            (
                *_final_and_best(train),
                *_final_and_best(held[:2] if held else None),
                _overshoot_summary(report),
            )
        )
    header = (
        "run",
        "variant",
        "final train (smoothed)",
        "best train (step)",
        "final held-out (smoothed)",
        "best held-out (step)",
        "overshoot",
    )
    rows = [
        (label, run.config.get("variant"), *cells)
        for label, run, cells in zip(labels, runs, per_run)
    ]
    pairs = []
    for run, label in zip(runs[1:], labels[1:]):
        result = _pair_crossover(runs[0], run, (labels[0], label))
        ratio = _eigen_ratio(runs[0], run)
        pairs.append(
            (
                f"{label} vs {labels[0]}",
                *_crossover_cells(result),
                *(_ratio_cells(ratio) if ratio is not None else ("not recorded",) * 3),
            )
        )
    pair_header = (
        "pair",
        "compared on",
        "ahead at start",
        "overtaken at step",
        "ends ahead",
        "by (smoothed)",
        "λ1 ratio, first",
        "λ1 ratio, median",
        "λ1 ratio, last",
    )
    warnings = _warnings(runs, labels)
    note = (
        f"<p class='note'>Losses smoothed by a centred moving average over 2h+1 records, "
        f"h = round({SMOOTH_FRACTION} × records). λ1 ratio: the run's top Hessian eigenvalue "
        f"over the reference's at the same step.</p>"
    )
    warning_table = ""
    if warnings:
        warning_table = html_table(("warning", "details"), warnings, ["warning"] * len(warnings))
    return warning_table + html_table(header, rows) + html_table(pair_header, pairs) + note


def _comparability_html(runs: list[Run], labels: list[str]) -> str:
    rows, classes = [], []
    for run, label in zip(runs[1:], labels[1:]):
        for check, differs, details in _checks(runs[0], run):
            rows.append(
                (f"{label} vs {labels[0]}", check, "differs" if differs else "same", details)
            )
            classes.append("warning" if differs else "")
    return html_table(("pair", "check", "status", "details"), rows, classes)


def _warnings(runs: list[Run], labels: list[str]) -> list[tuple[str, str]]:
    return [
        (f"⚠ {check} differs: {label} vs {labels[0]}", details)
        for run, label in zip(runs[1:], labels[1:])
        for check, differs, details in _checks(runs[0], run)
        if differs
    ]


def _checks(reference: Run, other: Run) -> list[tuple[str, bool, str]]:
    """``(check, differs, details)`` for θ0, data and the rest of the config."""
    hashes = reference.attrs.get("theta0_sha256"), other.attrs.get("theta0_sha256")
    if None in hashes:
        theta = (
            True,
            "θ0 hash not recorded in " + ("both runs" if hashes == (None, None) else "one run"),
        )
    else:
        theta = (hashes[0] != hashes[1], f"{hashes[0][:12]}… vs {hashes[1][:12]}…")
    differences = config_differences(reference.config, other.config)
    data = {k: v for k, v in differences.items() if k.split(".", 1)[0] == "data"}
    rest = {k: v for k, v in differences.items() if k not in data}
    return [
        ("θ0", *theta),
        ("data", bool(data), _describe(data) or "same data config"),
        ("config", bool(rest), _describe(rest) or "no difference beyond the variant"),
    ]


def _describe(differences: dict[str, tuple[Any, Any]]) -> str:
    shown = [f"{k}: {_json(a)} vs {_json(b)}" for k, (a, b) in list(differences.items())[:6]]
    more = len(differences) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def _config_html(runs: list[Run], labels: list[str]) -> str:
    flats = [_flatten(run.config) for run in runs]
    keys = sorted(set().union(*flats))
    differing = [k for k in keys if len({_json(f.get(k)) for f in flats}) > 1]
    if not differing:
        table = "<p>The configs are identical.</p>"
    else:
        rows = [(k, *(_json(f.get(k)) for f in flats)) for k in differing]
        classes = [
            "" if k.rsplit(".", 1)[-1] in IGNORED_CONFIG_KEYS else "warning" for k in differing
        ]
        table = "<p>Keys that differ:</p>" + html_table(("key", *labels), rows, classes)
    reference = json.dumps(runs[0].config, indent=2, sort_keys=True, default=str)
    return table + f"<h4>Config of {html.escape(labels[0])}</h4><pre>{html.escape(reference)}</pre>"


class _View(NamedTuple):
    """One comparison figure: a series of a group, reduced to one column for overlays."""

    key: str
    group: str
    name: str
    title: str
    y_title: str
    column: str | None = None  # "first", "last" or "mean" of the columns; None: a scalar
    log_y: bool = False


_OVERLAID = (
    _View(
        "last-layer-norm",
        "hidden_norms",
        "norm",
        "Hidden-state norm, last layer",
        "mean ‖h‖",
        column="last",
    ),
    _View(
        "activation-bias",
        "activation_bias",
        "mean",
        "Activation bias, mean over layers",
        "mean φ(z)",
        column="mean",
    ),
    _View("displacement", "displacement", "total", "Distance from θ0", "‖θt − θ0‖"),
    _View("update", "displacement", "update", "Update size", "‖θt+1 − θt‖", log_y=True),
    _View(
        "top-eigenvalue",
        "hessian",
        "eigenvalues",
        "Top Hessian eigenvalue λ1",
        "λ1",
        column="first",
        log_y=True,
    ),
)
_SIDE_BY_SIDE = (
    _View("hidden-norms", "hidden_norms", "norm", "Hidden-state norm per layer", "mean ‖h‖"),
    _View(
        "activation-bias-layers",
        "activation_bias",
        "mean",
        "Activation bias per layer",
        "mean φ(z)",
    ),
    _View("eigenvalues", "hessian", "eigenvalues", "Top Hessian eigenvalues", "eigenvalue"),
)


def _figures(runs: list[Run], labels: list[str]) -> list[tuple[str, go.Figure]]:
    colors = run_colors(len(runs))
    figures = [("loss", _loss_overlay(runs, labels, colors))]
    difference = _difference_figure(runs, labels, colors)
    if difference is not None:
        figures.append(("loss-difference", difference))
    for view in _OVERLAID:
        curves = _overlay_curves(runs, labels, colors, view)
        if curves:
            figure = line_figure(curves, title=view.title, y_title=view.y_title, log_y=view.log_y)
            figures.append((view.key, figure))
    ratio = _ratio_figure(runs, labels, colors)
    if ratio is not None:
        figures.append(("eigenvalue-ratio", ratio))
    for view in _SIDE_BY_SIDE:
        panels = _panels(runs, labels, view.group, view.name)
        if len(panels) > 1:
            title = view.title + ", side by side"
            figures.append((view.key, panels_figure(panels, title=title, y_title=view.y_title)))
        elif panels:
            _, step, values, columns = panels[0]
            figure = layer_figure(step, values, columns, title=view.title, y_title=view.y_title)
            figures.append((view.key, figure))
    return figures


def _loss_overlay(runs: list[Run], labels: list[str], colors: list[str]) -> go.Figure:
    curves = []
    for run, label, color in zip(runs, labels, colors):
        train, held = train_loss(run), heldout_loss(run)
        if train is not None:
            curves.append(Curve(f"{label} train", *train, color, group=label))
        if held is not None:
            curves.append(
                Curve(f"{label} held-out", *held[:2], color, dash="dash", markers=True, group=label)
            )
    return line_figure(curves, title="Loss", y_title="loss", log_y=True)


def _difference_figure(runs: list[Run], labels: list[str], colors: list[str]) -> go.Figure | None:
    curves, crossings = [], []
    for run, label, color in zip(runs[1:], labels[1:], colors[1:]):
        losses = _pair_losses(runs[0], run)
        if losses is None:
            continue
        metric, reference, other = losses
        (sa, a), (sb, b) = _finite(*reference), _finite(*other)
        steps, a, b = align(sa, smooth(a), sb, smooth(b))
        curves.append(Curve(f"{label} − {labels[0]} ({metric})", steps, b - a, color))
        result = crossover(*reference, *other, (labels[0], label), metric)
        if result is not None and result.step is not None:
            crossings.append((result.step, color, label))
    if not curves:
        return None
    figure = line_figure(
        curves,
        title="Smoothed loss difference (below zero: ahead of the reference)",
        y_title="Δ loss",
    )
    figure.add_hline(y=0, line_color="black", line_width=1)
    for step, color, label in crossings:
        figure.add_vline(
            x=step,
            line_dash="dot",
            line_color=color,
            annotation_text=f"{label} overtakes at {step:.0f}",
            annotation_font_size=10,
        )
    return figure


def _overlay_curves(
    runs: list[Run], labels: list[str], colors: list[str], view: _View
) -> list[Curve]:
    curves = []
    for run, label, color in zip(runs, labels, colors):
        rows = series(run, view.group)
        if rows is None or view.name not in rows.values:
            continue
        values = rows[view.name]
        if view.column == "last":
            values = values[:, -1]
        elif view.column == "first":
            values = values[:, 0]
        elif view.column == "mean":
            values = _nanmean_rows(values)
        curves.append(Curve(label, rows.step, values, color))
    return curves


def _ratio_figure(runs: list[Run], labels: list[str], colors: list[str]) -> go.Figure | None:
    curves = []
    for run, label, color in zip(runs[1:], labels[1:], colors[1:]):
        ratio = _eigen_ratio(runs[0], run)
        if ratio is not None:
            curves.append(Curve(f"{label} / {labels[0]}", *ratio, color))
    if not curves:
        return None
    figure = line_figure(
        curves,
        title="Ratio of top Hessian eigenvalues over time",
        y_title="λ1 ratio",
        log_y=True,
    )
    figure.add_hline(y=1, line_color="black", line_width=1)
    return figure


def _eigen_ratio(reference: Run, other: Run) -> tuple[np.ndarray, np.ndarray] | None:
    """``(steps, λ1 of other / λ1 of reference)`` where the reference's λ1 is positive."""
    ref, oth = series(reference, "hessian"), series(other, "hessian")
    if (
        ref is None
        or oth is None
        or "eigenvalues" not in ref.values
        or "eigenvalues" not in (oth.values)
    ):
        return None
    sa, a = _finite(ref.step, ref["eigenvalues"][:, 0])
    sb, b = _finite(oth.step, oth["eigenvalues"][:, 0])
    steps, a, b = align(sa, a, sb, b)
    positive = a > 0
    if not positive.any():
        return None
    return steps[positive], b[positive] / a[positive]


def _panels(
    runs: list[Run], labels: list[str], group: str, name: str
) -> list[tuple[str, np.ndarray, np.ndarray, list[str]]]:
    panels = []
    for run, label in zip(runs, labels):
        rows = series(run, group)
        if rows is None or name not in rows.values:
            continue
        values = rows[name]
        columns = rows.columns.get(name) or [f"{name}_{j}" for j in range(values.shape[1])]
        panels.append((label, rows.step, values, list(columns)))
    return panels


def _final_and_best(pair: tuple[np.ndarray, np.ndarray] | None) -> tuple[str, str]:
    if pair is None:
        return "not recorded", "not recorded"
    steps, values = _finite(*pair)
    if not len(values):
        return "no finite value", "no finite value"
    smoothed = smooth(values)
    best = int(np.argmin(smoothed))
    return f"{smoothed[-1]:.5g}", f"{smoothed[best]:.5g} ({steps[best]:g})"


def _overshoot_summary(report: OvershootReport | None) -> str:
    if report is None:
        return "no hidden-state norms"
    over = [layer.name for layer in report.layers if layer.overshoot]
    signature = [layer.name for layer in report.layers if layer.signature]
    text = f"{len(over)} of {len(report.layers)} layers"
    if over:
        text += f": {', '.join(over)}"
    if signature:
        text += f" (peak in the fastest-descent window: {', '.join(signature)})"
    return text


def _crossover_cells(result: Crossover | None) -> tuple[str, ...]:
    if result is None:
        return ("no overlapping loss", "—", "—", "—", "—")
    if result.winner is None:
        overtaken = "—"
    elif result.step is None:
        overtaken = f"none: {result.winner} ahead throughout"
    else:
        overtaken = f"{result.step:.0f}"
    return (
        result.metric,
        result.first_leader or "tie",
        overtaken,
        result.winner or "tie",
        f"{result.final_gap:.4g} ({result.final_gap_relative:.1%})",
    )


def _ratio_cells(ratio: tuple[np.ndarray, np.ndarray]) -> tuple[str, str, str]:
    steps, values = ratio
    return (
        f"{values[0]:.3g} (step {steps[0]:g})",
        f"{np.median(values):.3g}",
        f"{values[-1]:.3g} (step {steps[-1]:g})",
    )


def _labels(runs: list[Run]) -> list[str]:
    names = [run.name for run in runs]
    # Two runs named alike (e.g. "shifted" from two output folders) stay told apart.
    return [
        f"{name} ({run.path.parent.name}/{run.path.name})" if names.count(name) > 1 else name
        for name, run in zip(names, runs)
    ]


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def _finite(step: ArrayLike, values: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    step, values = np.asarray(step), np.asarray(values, dtype=float)
    keep = np.isfinite(values)
    return step[keep], values[keep]


def _finite_count(values: np.ndarray) -> int:
    return int(np.isfinite(values).sum())


def _nanmean_rows(values: np.ndarray) -> np.ndarray:
    # A row with every layer NaN stays NaN (a gap), without numpy's empty-slice warning.
    finite = np.isfinite(values)
    counts = finite.sum(axis=1)
    total = np.where(finite, values, 0.0).sum(axis=1)
    return np.where(counts > 0, total / np.maximum(counts, 1), np.nan)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
