"""The paper's Fig. 3 for any two runs that share θ0: a plane through θ0 and each run's
Gram–Schmidt out-of-plane view, each with loss heatmaps and re-projected trajectories.

The plane is the one of the two runs' initial gradients, or — for runs whose initial gradients
coincide, or when asked — the plane of the initial gradient and the direction between the
endpoints, a PCA plane of both runs' snapshots, or a random filter-normalized plane.
Trajectories come from the run files (snapshots, θT); heatmaps and losses from a
:class:`~dynamics.geometry.landscape.LossSurface` per run (a model rebuilt offline), or from the
views a run evaluated in its training process at the end of fit (``GradientPlane(at_end=True)``).

Views are planned first (planes, grids, trajectories), then their grids are evaluated a chunk
of rows at a time, so a caller can write each chunk as it is finished.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import h5py
import numpy as np

from dynamics.analysis.output import PLANE_GRID_SCHEMA, replacing
from dynamics.errors import DynamicsError, ParameterError
from dynamics.geometry.landscape import (
    LossSurface,
    PlaneView,
    Progress,
    Trajectory,
    evaluate_grid,
    in_plane_share,
    trajectory,
)
from dynamics.geometry.plane import (
    CollinearGradients,
    Grid,
    Plane,
    covering_grid,
    missing_plane_data,
    near_paths,
    out_of_plane_view,
    pca_plane,
    plane_from_gradient_and_endpoints,
    plane_from_gradients,
    random_filter_normalized_plane,
)
from dynamics.store import Run, names
from dynamics.system import check_fits

#: The planes ``dynamics plane --plane`` offers; ``auto`` is ``gradients`` unless they coincide.
PLANE_CHOICES = ("auto", "gradients", "gradient-endpoints", "pca", "random")
#: Largest entry-wise difference between a stored basis and the chosen one that is the same plane.
SAME_BASIS_TOLERANCE = 1e-9
#: Float64 arrays a grid point costs at least: the losses of two views per run, and the
#: coordinates of a mesh (what :func:`check_grid_side` asks the memory for).
GRID_ARRAYS = 6
#: The largest margin around the trajectories: a grid 201 times their range shows them as a dot.
MAX_MARGIN = 100.0
_LABELS = {
    "gradients": "initial-gradient plane",
    "gradient-endpoints": "plane of g0 and the endpoints' direction",
    "pca": "PCA plane of both runs' snapshots",
    "random-filter-normalized": "random filter-normalized plane",
}
#: Called with ``(view index, dataset, first row, rows)`` as each chunk of a heatmap (dataset
#: ``losses``, or ``coarse_losses``) is finished.
ViewRowsDone = Callable[[int, str, int, np.ndarray], None]


@dataclass(frozen=True)
class ChosenPlane:
    """The plane two runs are compared on, why it was chosen, and the runs' checkpoints.

    Attributes:
        plane: the plane through the shared θ0.
        reason: one line on how it was chosen (e.g. why the gradient plane could not be used).
        checkpoints: ``{run name: (steps, θs)}``: snapshots followed by θT, the finite ones.
        diverged: ``{run name: one line}`` of the runs whose training diverged, leaving θT not
            finite: their checkpoints end before it, and they get no out-of-plane view.
    """

    plane: Plane
    reason: str
    checkpoints: dict[str, tuple[np.ndarray, np.ndarray]]
    diverged: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredViews:
    """A run's views evaluated in its training process at the end of fit."""

    trajectory: Trajectory  # on the plane
    plane_view: PlaneView  # its trajectories are set when the views are planned
    out_of_plane: PlaneView


def plane_label(plane: Plane) -> str:
    """How a plane is named on the page: ``initial-gradient plane``, ``PCA plane ...``."""
    return _LABELS.get(plane.kind, plane.kind)


def check_plane_settings(
    plane: str = "auto",
    grid_side: int = 41,
    margin: float = 0.25,
    coarse: int | None = None,
    processes: int | None = None,
) -> None:
    """Refuse settings of :func:`~dynamics.analysis.pages.plane.write_plane` that cannot work,
    before any run is read: the one place these values are checked.

    Raises:
        ParameterError: naming ``plane`` (not one of :data:`PLANE_CHOICES`), ``grid_side``
            (below 2, or a grid that cannot fit in the memory available), ``margin`` (not a
            number from 0 to :data:`MAX_MARGIN`), ``coarse`` (not from 2 to ``grid_side``) or
            ``processes`` (not from 1 to this machine's cores).

    Example::

        check_plane_settings(grid_side=41, coarse=9)  # fine
        check_plane_settings(grid_side=1)  # ParameterError: grid_side must be at least 2, got 1
    """
    check_plane_kind(plane)
    check_grid_side(grid_side)
    if not (math.isfinite(margin) and 0 <= margin <= MAX_MARGIN):
        raise ParameterError("margin", f"must be a number from 0 to {MAX_MARGIN}, got {margin}")
    if coarse is not None and not 2 <= coarse <= grid_side:
        raise ParameterError(
            "coarse", f"must be between 2 and the grid side ({grid_side}), got {coarse}"
        )
    cores = os.cpu_count() or 1
    if processes is not None and not 1 <= processes <= cores:
        raise ParameterError(
            "processes",
            f"must be at least 1 and at most this machine's {cores} cores, got {processes}",
        )


def check_plane_kind(kind: str) -> None:
    """Refuse a plane that is not one of :data:`PLANE_CHOICES`.

    Raises:
        ParameterError: naming ``plane``.
    """
    if kind not in PLANE_CHOICES:
        raise ParameterError("plane", f"must be one of {', '.join(PLANE_CHOICES)}, got {kind!r}")


def check_grid_side(grid_side: int) -> None:
    """Refuse a grid of fewer than 2 points per axis, or one the memory available cannot hold
    (:data:`GRID_ARRAYS` float64 arrays of its points at least).

    Raises:
        ParameterError: naming ``grid_side``.
    """
    if grid_side < 2:
        raise ParameterError("grid_side", f"must be at least 2, got {grid_side}")
    try:
        check_fits(str(grid_side), GRID_ARRAYS * 8 * grid_side**2)
    except DynamicsError as error:  # "<grid_side> needs at least ... GiB of memory; ..."
        raise ParameterError("grid_side", str(error)) from None


def choose_plane(
    run_a: Run, run_b: Run, kind: str = "auto", grid_side: int = 41, seed: int = 0
) -> ChosenPlane:
    """Check two runs can be compared on a plane, and build it.

    Cheap: call it before rebuilding models, so bad input is refused first.

    Args:
        run_a: the first run (its g0 gives u for the gradient planes).
        run_b: the second run.
        kind: one of :data:`PLANE_CHOICES`. ``auto`` takes the initial-gradient plane unless
            the gradients are collinear, then the plane of run A's g0 and θT_b − θT_a, and
            says why in ``reason``.
        grid_side: grid points per axis, checked here.
        seed: the random plane's seed.

    Raises:
        DynamicsError: the runs share a name, differ in θ0 or parameter layout, lack what
            the plane needs (g0, snapshots, θT), or the plane is degenerate (e.g. collinear
            gradients with ``kind="gradients"``).
        ParameterError: ``kind`` is unknown, or ``grid_side`` is below 2 (see
            :func:`check_grid_side`).

    Example::

        chosen = choose_plane(open_run("runs/a.h5"), open_run("runs/b.h5"), "auto")
        print(chosen.reason)
    """
    check_plane_kind(kind)
    if run_a.name == run_b.name:
        raise DynamicsError("the two runs need different names (file stems or run_name)")
    check_grid_side(grid_side)
    runs = [run_a, run_b]
    theta0 = _check_comparable(runs)
    checkpoints = {r.name: stored_checkpoints(r) for r in runs}
    diverged = {r.name: note for r in runs if (note := divergence_note(r))}
    pair = f"{run_a.path.name} and {run_b.path.name}"
    try:  # the runs' own vectors, so a degenerate plane is the user's input
        if kind in ("auto", "gradients"):
            gradients = [_g0(r) for r in runs]
            try:
                plane = plane_from_gradients(theta0, *gradients)
                return ChosenPlane(
                    plane, "the plane of the two runs' initial gradients", checkpoints, diverged
                )
            except CollinearGradients as error:
                if kind == "gradients":
                    other = ParameterError("plane", "gradient-endpoints, pca or random")
                    raise DynamicsError(f"{error}; {other} still compare them").quoting(
                        other
                    ) from None
                collinear = error
            try:
                endpoints = _endpoints(runs, diverged)
                plane = plane_from_gradient_and_endpoints(theta0, gradients[0], *endpoints)
            except DynamicsError as error:
                raise DynamicsError(f"{collinear}, and {error}") from None
            reason = (
                f"initial gradients coincide ({collinear}): using the plane of {run_a.name}'s "
                "initial gradient and the direction between the two runs' endpoints"
            )
            return ChosenPlane(plane, reason, checkpoints, diverged)
        if kind == "gradient-endpoints":
            g = _g0(run_a)
            plane = plane_from_gradient_and_endpoints(theta0, g, *_endpoints(runs, diverged))
            reason = f"the plane of {run_a.name}'s initial gradient and θT_b − θT_a (asked)"
        elif kind == "pca":
            plane = pca_plane(theta0, np.vstack([checkpoints[r.name][1] for r in runs]))
            reason = "the PCA plane of both runs' snapshots and endpoints (asked)"
        else:
            plane = random_filter_normalized_plane(theta0, run_a.layout, seed)
            reason = f"a random filter-normalized plane, seed {seed} (asked)"
    except DynamicsError as error:
        raise DynamicsError(f"{pair}: {error}") from None
    return ChosenPlane(plane, reason, checkpoints, diverged)


def stored_views(run: Run, plane: Plane) -> StoredViews | None:
    """The views ``run`` evaluated at the end of its fit on ``plane``; None if it has none there.

    They are used only when the run's plane (``plane_u``, ``plane_v``) is ``plane``'s.
    """
    losses = run.vector(names.plane_end(names.PLANE_END_VIEWS[0], "losses"))
    u, v = run.vector(names.PLANE_U), run.vector(names.PLANE_V)
    if losses is None or u is None or v is None:
        return None
    if max(np.abs(u - plane.u).max(), np.abs(v - plane.v).max()) > SAME_BASIS_TOLERANCE:
        return None
    steps = run.vector(names.PLANE_END_STEPS)
    kept = ~np.isnan(steps)
    probes = run.attrs.get(names.ATTR_PROBES, [])
    mode = next((p["settings"].get("mode") for p in probes if p["name"] == names.PLANE), None)
    source = (
        f"evaluated in the training process at the end of fit ({mode} mode, with the "
        "module's buffers at the end of fit)"
    )

    def read(view: str) -> tuple[Grid, np.ndarray, Trajectory]:
        rows = run.vector(names.plane_end(view, "trajectory"))[kept]
        columns = dict(zip(names.PLANE_END_TRAJECTORY_COLUMNS, rows.T))
        grid = Grid(
            run.vector(names.plane_end(view, "alphas")), run.vector(names.plane_end(view, "betas"))
        )
        losses = run.vector(names.plane_end(view, "losses"))
        return grid, losses, Trajectory(run.name, steps[kept].astype(np.int64), **columns)

    grid, losses, on_plane = read(names.PLANE_END_VIEWS[0])
    title = f"{plane_label(plane)}, loss of {run.name} (in training)"
    plane_view = PlaneView(title, plane, grid, run.name, losses, [], {}, source)
    second_grid, second_losses, second = read(names.PLANE_END_VIEWS[1])
    basis = [run.vector(names.plane_end(names.PLANE_END_VIEWS[1], w)) for w in ("u", "v")]
    share = in_plane_share(on_plane)
    second_plane = Plane(
        plane.origin, *basis, "out-of-plane", {"in_plane_share": share, "parent_kind": plane.kind}
    )
    out_of_plane = PlaneView(
        f"out-of-plane view of {run.name} (p̂, w) (in training)",
        second_plane,
        second_grid,
        run.name,
        second_losses,
        [second],
        {f"in-plane share of ‖θT − θ0‖², {run.name}": share},
        source,
    )
    return StoredViews(on_plane, plane_view, out_of_plane)


def recorded_views(run: Run) -> list[PlaneView] | None:
    """The views one run evaluated at the end of its fit, each with its own trajectory only;
    None if it has none."""
    theta0, u, v = (run.vector(n) for n in (names.THETA0, names.PLANE_U, names.PLANE_V))
    if theta0 is None or u is None or v is None:
        return None
    probes = run.attrs.get(names.ATTR_PROBES, [])
    at_end = next((p["settings"].get("at_end") for p in probes if p["name"] == names.PLANE), None)
    plane = Plane(theta0, u, v, (at_end or {}).get("kind", "gradients"))
    stored = stored_views(run, plane)
    if stored is None:
        return None
    share = stored.out_of_plane.notes
    return [
        replace(stored.plane_view, trajectories=[stored.trajectory], notes=share),
        stored.out_of_plane,
    ]


def planned_views(
    runs: list[Run],
    chosen: ChosenPlane,
    surfaces: dict[str, LossSurface],
    stored: dict[str, StoredViews],
    grid_side: int = 41,
    margin: float = 0.25,
    progress: Progress | None = None,
    coarse: int | None = None,
) -> list[PlaneView]:
    """Both runs on the chosen plane, then each run's out-of-plane view; grids not evaluated.

    A run's views come from ``stored`` when it has them, else from its surface (the views'
    ``losses`` are left None for :func:`evaluate_views`); a run with neither gets no heatmap,
    and its trajectory is drawn with NaN losses.

    Args:
        runs: the two runs.
        chosen: the plane, as :func:`choose_plane` returns it.
        surfaces: ``{run name: LossSurface}`` of each rebuilt run's model on its probe batch.
        stored: ``{run name: StoredViews}`` of runs that evaluated their views in training.
        grid_side: grid points per axis (≥ 2).
        margin: extra fraction of the trajectories' range on each side of the grid.
        progress: told of each trajectory loss evaluated.
        coarse: coarse to fine (2 ≤ ``coarse`` ≤ ``grid_side``): each grid to evaluate gets a
            ``coarse``×``coarse`` grid over its whole extent, and its own points are evaluated
            only within one coarse cell of the trajectories drawn on it.
    """
    plane = chosen.plane
    on_plane = {
        r.name: stored[r.name].trajectory
        if r.name in stored
        else trajectory(r.name, plane, *chosen.checkpoints[r.name], surfaces.get(r.name), progress)
        for r in runs
    }
    grid = covering_grid(
        [(t.a, t.b) for t in on_plane.values()],
        num_alphas=grid_side,
        num_betas=grid_side,
        margin=margin,
    )
    shares = {  # a diverged run's last finite checkpoint is not its θT
        f"in-plane share of ‖θT − θ0‖², {t.run}": in_plane_share(t)
        for t in on_plane.values()
        if t.run not in chosen.diverged
    }
    trajectories = list(on_plane.values())
    views = []
    for r in runs:
        if r.name in stored:
            views.append(
                replace(stored[r.name].plane_view, trajectories=trajectories, notes=shares)
            )
        elif r.name in surfaces:
            title = f"{plane_label(plane)}, loss of {r.name}"
            views.append(
                PlaneView(
                    title,
                    plane,
                    grid,
                    r.name,
                    None,
                    trajectories,
                    shares,
                    buffers=surfaces[r.name].buffer_note,
                )
            )
    for r in runs:
        if r.name in stored:
            views.append(stored[r.name].out_of_plane)
        elif r.name in surfaces and r.name not in chosen.diverged:  # p̂ needs a finite θT
            views.append(
                _out_of_plane(r.name, plane, chosen, surfaces[r.name], grid_side, margin, progress)
            )
    if coarse is None:
        return views
    radius = (grid_side - 1) / (coarse - 1)  # one coarse cell, in fine grid steps
    return [
        view
        if view.losses is not None
        else replace(
            view,
            coarse_grid=Grid(
                *(np.linspace(x[0], x[-1], coarse) for x in (view.grid.alphas, view.grid.betas))
            ),
            refine=near_paths(view.grid, [(t.a, t.b) for t in view.trajectories], radius),
        )
        for view in views
    ]


def evaluate_views(
    views: list[PlaneView],
    surfaces: dict[str, LossSurface],
    progress: Progress | None = None,
    distributed: bool = False,
    on_rows: ViewRowsDone | None = None,
) -> list[PlaneView]:
    """``views`` with every grid not yet evaluated evaluated (see :func:`evaluate_grid`):
    all coarse grids first, then the full ones (only where they are refined)."""

    def evaluated(index: int, grid: Grid, plane: Plane, run: str, dataset: str, where=None):
        return evaluate_grid(
            surfaces[run],
            plane,
            grid,
            progress=progress,
            distributed=distributed,
            on_rows=None if on_rows is None else _rows_of(on_rows, index, dataset),
            where=where,
        )

    views = [
        view
        if view.coarse_grid is None or view.coarse_losses is not None
        else replace(
            view,
            coarse_losses=evaluated(index, view.coarse_grid, view.plane, view.run, "coarse_losses"),
        )
        for index, view in enumerate(views)
    ]
    return [
        view
        if view.losses is not None
        else replace(
            view,
            losses=evaluated(index, view.grid, view.plane, view.run, "losses", view.refine),
        )
        for index, view in enumerate(views)
    ]


def points_to_evaluate(views: list[PlaneView]) -> int:
    """Grid points left to evaluate in ``views``."""
    total = 0
    for view in views:
        if view.losses is None:
            total += view.grid.size if view.refine is None else int(view.refine.sum())
        if view.coarse_grid is not None and view.coarse_losses is None:
            total += view.coarse_grid.size
    return total


@contextmanager
def views_file(views: list[PlaneView], path: Path, remarks: list[str]) -> Iterator[ViewRowsDone]:
    """Write the views' planes, grids and trajectories now, their heatmaps as rows come.

    Yields the function that writes a chunk of a heatmap's rows (and flushes the file). The
    file is written beside ``path`` and renamed into place when the block ends
    (:func:`~dynamics.analysis.output.replacing`); an interrupted evaluation leaves its finished
    rows at ``path`` only where no file was (heatmap entries not evaluated read as NaN, and the
    root attribute ``complete`` is true only once the block exits normally).
    """
    with replacing(path, keep_unfinished=True) as temporary, h5py.File(temporary, "w") as file:
        file.attrs.update(schema=PLANE_GRID_SCHEMA, complete=False, remarks=json.dumps(remarks))
        for index, view in enumerate(views):
            group = file.create_group(f"view{index}")
            group.attrs.update(
                title=view.title,
                run=view.run,
                kind=view.plane.kind,
                source=view.source,
                metadata=json.dumps(dict(view.plane.metadata), default=_jsonable),
                notes=json.dumps(view.notes),
                buffers=view.buffers,
            )
            group["alphas"], group["betas"] = view.grid.alphas, view.grid.betas
            group["losses"] = (
                view.losses if view.losses is not None else np.full(view.grid.shape, np.nan)
            )
            group["u"], group["v"] = view.plane.u, view.plane.v
            if view.coarse_grid is not None:
                group["coarse_alphas"] = view.coarse_grid.alphas
                group["coarse_betas"] = view.coarse_grid.betas
                group["coarse_losses"] = np.full(view.coarse_grid.shape, np.nan)
                group["refined"] = view.refine
            for t in view.trajectories:
                sub = group.create_group(f"trajectory/{t.run}")
                for name in ("step", "a", "b", "r", "loss", "plane_loss"):
                    sub[name] = getattr(t, name)
        file.flush()

        def write_rows(index: int, dataset: str, first: int, rows: np.ndarray) -> None:
            file[f"view{index}/{dataset}"][first : first + len(rows)] = rows
            file.flush()

        yield write_rows
        file.attrs["complete"] = True


def _rows_of(on_rows: ViewRowsDone, index: int, dataset: str) -> Callable[[int, np.ndarray], None]:
    return lambda first, rows: on_rows(index, dataset, first, rows)


def _out_of_plane(
    run: str,
    plane: Plane,
    chosen: ChosenPlane,
    surface: LossSurface,
    grid_side: int,
    margin: float,
    progress: Progress | None,
) -> PlaneView:
    steps, thetas = chosen.checkpoints[run]
    second, share = out_of_plane_view(plane, thetas[-1])
    path = trajectory(run, second, steps, thetas, surface, progress)
    grid = covering_grid(
        [(path.a, path.b)], num_alphas=grid_side, num_betas=grid_side, margin=margin
    )
    return PlaneView(
        f"out-of-plane view of {run} (p̂, w)",
        second,
        grid,
        run,
        None,
        [path],
        {f"in-plane share of ‖θT − θ0‖², {run}": share},
        buffers=surface.buffer_note,
    )


def _check_comparable(runs: list[Run]) -> np.ndarray:
    first, second = runs
    if not first.shares_theta0(second):
        raise DynamicsError(f"{first.path.name} and {second.path.name} do not share θ0")
    if first.layout != second.layout:
        raise DynamicsError(f"{first.path.name} and {second.path.name} differ in parameter layout")
    return _vector(first, names.THETA0, "θ0").astype(np.float64)


def _g0(run: Run) -> np.ndarray:
    g0 = run.vector(names.G0)
    if g0 is None:
        raise missing_plane_data(run, "initial gradient g0")
    return g0


def _vector(run: Run, name: str, what: str) -> np.ndarray:
    value = run.vector(name)
    if value is None:
        raise DynamicsError(f"{run.path.name}: no {what} stored")
    return value


def stored_checkpoints(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """A run's stored parameter snapshots followed by θT: ``(steps, θs)``, θT at the step
    after the last training step. Of a run that diverged, the finite ones only.

    Raises:
        DynamicsError: the run stored no snapshots or no θT, or diverged before any finite
            snapshot.
    """
    snapshots = run.recorded(names.SNAPSHOTS)
    if snapshots is None:
        raise DynamicsError(f"{run.path.name}: no parameter snapshots (ParameterDisplacement)")
    final = _vector(run, names.THETA_FINAL, "final parameters θT")
    loss = run.train_loss()
    last = (loss.step if loss is not None else snapshots.step)[-1] + 1
    steps = np.append(snapshots.step, last)
    thetas = np.vstack([snapshots[names.SNAPSHOT_THETA], final])
    if run.diverged_at is None:
        return steps, thetas
    finite = np.isfinite(thetas).all(axis=1)
    if not finite.any():
        raise DynamicsError(
            f"{run.path.name}: diverged at step {run.diverged_at}, before any finite snapshot"
        )
    return steps[finite], thetas[finite]


def divergence_note(run: Run) -> str:
    """One line on a run whose training diverged, leaving θT not finite; ``""`` otherwise."""
    if run.diverged_at is None:
        return ""
    final = run.vector(names.THETA_FINAL)
    if final is None or np.isfinite(final).all():
        return ""
    return f"{run.path.name} diverged at step {run.diverged_at} (its θT is not finite)"


def _endpoints(runs: list[Run], diverged: dict[str, str]) -> list[np.ndarray]:
    """Both runs' θT, for the direction between them; refused when a run diverged."""
    for run in runs:
        if run.name in diverged:
            raise DynamicsError(f"{diverged[run.name]}, so no direction joins the endpoints")
    return [_vector(run, names.THETA_FINAL, "final parameters θT") for run in runs]


def _jsonable(value: object) -> object:
    return dict(value) if hasattr(value, "keys") else float(value)
