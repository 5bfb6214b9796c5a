"""The loss along straight lines between runs' parameters, and the barrier each line crosses.

For runs compared with a reference, :func:`loss_barriers` evaluates the loss at
θ(α) = (1 − α)·start + α·end for evenly spaced α in [0, 1] on three kinds of line: from the
reference's θT to each other run's θT, and from θ0 to θT of every run. A line's barrier height
is the largest loss along it minus the mean of the losses at its ends (so defined it is
never below 0, and half the ends' difference on a line that only falls); its height above the
chord, the largest L(α) − ((1 − α)·L(0) + α·L(1)), is 0 when the line never rises above the
straight line joining its ends' losses (no bump between them) and positive when it climbs over
a ridge.

The loss is the one the plane views draw (:func:`~dynamics.analysis.plane_run.rebuilt_surface`):
the model rebuilt from the run file, in eval mode, on the stored probe batch, by the loss rule
of :mod:`dynamics.loss_rule`. A line between two runs uses the reference's model and probe
batch, and each point the buffers (BatchNorm statistics) of the stored state of either run
nearest to it (:mod:`dynamics.nearest_buffers`), so each end is evaluated with its own run's
final buffers; it is drawn only for runs whose recorded models agree in class, model edits and
submodules (a shifted and an unshifted network are two loss functions: no line joins them in
one). A run whose model cannot be rebuilt, or that stores no probe batch, θ0 or θT,
gets a one-line remark instead of its lines; the comparison goes on.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from dynamics.analysis.comparison import NOT_RECORDED, SAME, comparability
from dynamics.analysis.figures import Curve, line_figure, run_colors
from dynamics.analysis.page import figure_html, html_table
from dynamics.errors import DynamicsError
from dynamics.store import Run, names

#: Points evaluated along each line, the ends included (α = 0, 0.05, ..., 1).
POINTS = 21
#: The comparability checks two runs must agree in for the reference's model to be theirs.
_SAME_FUNCTION = ("module", "model edits", "submodules")


@dataclass(frozen=True)
class LinePath:
    """The loss along one straight line in parameter space.

    Attributes:
        name: which line, e.g. ``θT(a) → θT(b)``.
        run: the run it is drawn for (its colour): θ0 → θT's run, or the run compared with
            the reference on a line between their θT.
        between_runs: a line between two runs' θT (drawn dashed), not θ0 → θT of one.
        alphas: the interpolation coefficients, from 0 (the start) to 1 (the end).
        losses: the loss at each α.
        batch: whose probe batch and model the losses are computed with.
        buffers: which buffers the points use (empty when the model has none).
    """

    name: str
    run: str
    between_runs: bool
    alphas: np.ndarray
    losses: np.ndarray
    batch: str
    buffers: str = ""

    @property
    def barrier(self) -> float:
        """The largest loss along the line minus the mean of the losses at its ends."""
        return float(np.max(self.losses) - (self.losses[0] + self.losses[-1]) / 2)

    @property
    def above_chord(self) -> float:
        """The largest height of the loss above the straight line between its ends'
        losses, max over α of L(α) − ((1 − α)·L(0) + α·L(1)): 0 for a line that never rises
        above its chord (e.g. a monotone or convex one), where :attr:`barrier` is still
        half the ends' difference."""
        chord = (1 - self.alphas) * self.losses[0] + self.alphas * self.losses[-1]
        return float(np.max(self.losses - chord))

    @property
    def peak_alpha(self) -> float:
        """Where along the line the loss is largest."""
        return float(self.alphas[int(np.argmax(self.losses))])


@dataclass(frozen=True)
class Barriers:
    """The lines evaluated between compared runs, and why any could not be."""

    lines: list[LinePath]
    remarks: list[str]


def line_losses(surface, start: np.ndarray, end: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """The loss of ``surface`` (a :class:`~dynamics.landscape.LossSurface`) at
    (1 − α)·start + α·end for each α, the points formed in float64 (the ends exactly)."""
    start, end = np.asarray(start, np.float64), np.asarray(end, np.float64)
    return np.array([surface.loss((1 - alpha) * start + alpha * end) for alpha in alphas])


def loss_barriers(
    runs: Sequence[Run],
    labels: Sequence[str],
    points: int = POINTS,
    *,
    model: str | None = None,
    init_args: dict | None = None,
    trust_recorded_model: bool = False,
) -> Barriers:
    """The loss along θT(reference) → θT(run) for every other run, and θ0 → θT of each run.

    Args:
        runs: the runs; the first is the reference.
        labels: their names on the page.
        points: points per line, the ends included (at least 2).
        model: build each run's model with this class or factory instead of the recorded one.
        init_args: init args completing or overriding the recorded ones.
        trust_recorded_model: import a recorded class from outside the installed packages.

    Returns:
        The lines evaluated, and a one-line remark for each run or pair that could not be.

    Raises:
        DynamicsError: ``points`` below 2.
    """
    if points < 2:
        raise DynamicsError(f"a loss-barrier line needs at least 2 points, got {points}")
    alphas = np.linspace(0.0, 1.0, points)
    lines, remarks = [], []
    candidates = []  # (run, label) of the runs that store what a line needs
    lacking: dict[str, list[str]] = {}  # what is missing: the runs that lack it
    for run, label in zip(runs, labels):
        missing = _missing(run)
        if missing:
            lacking.setdefault(missing, []).append(label)
        else:
            candidates.append((run, label))
    remarks += [
        f"no loss barrier for {', '.join(who)}: no {missing} stored"
        for missing, who in lacking.items()
    ]
    if not candidates:
        return Barriers(lines, remarks)
    # Imported only now: a comparison of runs without lines to draw never loads torch.
    from dynamics.analysis.plane_run import rebuilt_surface

    usable = {}  # label: run, for the runs whose own line could be evaluated
    for run, label in candidates:
        try:
            theta0, theta_final = _endpoints(run)
            surface = rebuilt_surface(run, model, init_args, trust_recorded_model)
        except DynamicsError as error:
            remarks.append(f"no loss barrier for {label}: {error}")
            continue
        usable[label] = run
        lines.append(
            LinePath(
                f"θ0 → θT ({label})",
                label,
                False,
                alphas,
                line_losses(surface, theta0, theta_final, alphas),
                label,
                surface.buffer_note,
            )
        )
    reference, first = runs[0], labels[0]
    if first not in usable:
        return Barriers(lines, remarks)
    for run, label in zip(runs[1:], labels[1:]):
        if label not in usable:
            continue
        if run.layout != reference.layout:
            remarks.append(f"no θT line {first} → {label}: their parameter layouts differ")
            continue
        differs = _other_function(reference, run, (first, label))
        if differs:
            remarks.append(f"no θT line {first} → {label}: {differs}")
            continue
        try:
            surface = rebuilt_surface(
                reference, model, init_args, trust_recorded_model, buffers_of=[reference, run]
            )
        except DynamicsError as error:
            remarks.append(f"no θT line {first} → {label}: {error}")
            continue
        start, end = (_endpoints(r)[1] for r in (reference, run))
        lines.append(
            LinePath(
                f"θT({first}) → θT({label})",
                label,
                True,
                alphas,
                line_losses(surface, start, end, alphas),
                first,
                surface.buffer_note,
            )
        )
    return Barriers(lines, remarks)


def barrier_section(
    barriers: Barriers, labels: Sequence[str], index: int
) -> tuple[str, go.Figure | None]:
    """The comparison page's section: the barrier heights as a table with the remarks, and
    the figure of loss against α (None: no line), drawn as the page's figure ``index``."""
    colors = dict(zip(labels, run_colors(len(labels))))
    figure = _barrier_figure(barriers, colors)
    section = "<h2>Loss barriers</h2>" + _barrier_html(barriers)
    if figure is not None:
        section += figure_html(figure, index)
    return section, figure


def _barrier_html(barriers: Barriers) -> str:
    rows = [
        (
            line.name,
            f"{line.losses[0]:.5g}",
            f"{line.losses[-1]:.5g}",
            f"{np.max(line.losses):.5g} (α = {line.peak_alpha:.2f})",
            f"{line.barrier:.4g}",
            f"{line.above_chord:.4g}",
            line.batch,
        )
        for line in barriers.lines
    ]
    parts = []
    if rows:
        header = (
            "line",
            "loss at α = 0",
            "loss at α = 1",
            "max",
            "barrier",
            "above the chord",
            "probe batch of",
        )
        parts.append(html_table(header, rows))
        notes = dict.fromkeys(line.buffers for line in barriers.lines if line.buffers)
        parts.append(
            "<p class='note'>Loss at (1 − α)·start + α·end, the model rebuilt from the run "
            "file in eval mode on a run's stored probe batch; barrier: max along the line "
            "minus the mean of its ends (never below 0: half the ends' difference on a line "
            "that only falls); above the chord: the largest height of the loss above the "
            "straight line joining its ends' losses (0: no bump between them). "
            + " ".join(html.escape(note) for note in notes)
            + "</p>"
        )
    parts += [f"<p class='note'>{html.escape(remark)}</p>" for remark in barriers.remarks]
    return "".join(parts)


def _barrier_figure(barriers: Barriers, colors: dict[str, str]) -> go.Figure | None:
    """Loss against the interpolation coefficient α, one curve per line; None: no line.

    ``colors`` maps a run's label to its colour; lines between two runs are dashed.
    """
    if not barriers.lines:
        return None
    curves = [
        Curve(
            line.name,
            line.alphas,
            line.losses,
            colors.get(line.run),
            dash="dash" if line.between_runs else "solid",
            markers=True,
        )
        for line in barriers.lines
    ]
    figure = line_figure(
        curves, title="Loss along straight lines between parameters", y_title="loss"
    )
    figure.update_xaxes(title_text="α (0: start, 1: end)")
    return figure


def _other_function(reference: Run, run: Run, labels: tuple[str, str]) -> str:
    """Why the reference's model is not a model of ``run`` (another class, another edit such
    as a shift, other submodules), in one line; empty when nothing recorded says so. Init
    args may differ (a learning rate): the line is drawn in the reference's model."""
    for check in comparability(reference, run, labels):
        if check.name in _SAME_FUNCTION and check.status not in (SAME, NOT_RECORDED):
            return (
                f"their models differ in {check.name} ({check.details}), so no one loss "
                "function holds both ends"
            )
    return ""


def _missing(run: Run) -> str:
    """What a run lacks for its lines, read from its file without torch; empty: nothing."""
    stored = set(run.vector_names)
    if not {names.THETA0, names.THETA_FINAL} <= stored:
        return "θ0 or θT (ParameterDisplacement records them)"
    if not any(name.startswith(names.PROBE_BATCH_PREFIX) for name in stored):
        return "probe batch (GradientPlane records it)"
    return ""


def _endpoints(run: Run) -> tuple[np.ndarray, np.ndarray]:
    theta0, theta_final = run.vector(names.THETA0), run.vector(names.THETA_FINAL)
    if theta0 is None or theta_final is None:
        raise DynamicsError(
            f"{run.path.name} stores no θ0 or θT (ParameterDisplacement records them)"
        )
    return theta0, theta_final
