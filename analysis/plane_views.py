"""The paper's Fig. 3 for any two runs that share θ0: the initial-gradient plane and the
Gram–Schmidt out-of-plane view, each with loss heatmaps and re-projected trajectories.

Everything is rebuilt from the run files: θ0, each run's initial gradient g0, parameter
snapshots, θT, and (through a caller-supplied :class:`LossSurface` per run) the model and its
stored probe batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from dynamics.errors import DynamicsError
from dynamics.landscape import LossSurface, evaluate_grid
from dynamics.plane import (
    Grid,
    Plane,
    covering_grid,
    out_of_plane_view,
    plane_from_gradients,
    project,
)
from dynamics.store import Run, names


@dataclass(frozen=True)
class Trajectory:
    """A run's checkpoints on a plane, with the loss there and the loss read off the plane."""

    run: str
    step: np.ndarray
    a: np.ndarray
    b: np.ndarray
    r: np.ndarray
    loss: np.ndarray  # at the real checkpoints θt
    plane_loss: np.ndarray  # at their projections θ0 + a·u + b·v


@dataclass(frozen=True)
class PlaneView:
    """One plane, the loss heatmap of one run's model on it, and trajectories drawn over it."""

    title: str
    plane: Plane
    grid: Grid
    run: str  # whose model the heatmap evaluates
    losses: np.ndarray  # (len(betas), len(alphas))
    trajectories: list[Trajectory]
    notes: dict[str, float] = field(default_factory=dict)


def initial_gradient_plane(
    run_a: Run, run_b: Run, grid_side: int = 41
) -> tuple[Plane, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Check two runs can be compared on a plane; their initial-gradient plane and checkpoints.

    Cheap: call it before rebuilding models, so bad input is refused first.

    Returns:
        The plane (u from ``run_a``'s g0, v from ``run_b``'s) and ``{run name: (steps, θs)}``
        of snapshots followed by θT.

    Raises:
        DynamicsError: the runs share a name, differ in θ0 or parameter layout, lack g0,
            snapshots or θT, their initial gradients are zero or collinear (they span no plane),
            or ``grid_side`` is below 2.
    """
    if run_a.name == run_b.name:
        raise DynamicsError("the two runs need different names (file stems or run_name)")
    if grid_side < 2:
        raise DynamicsError(f"--grid must be at least 2, got {grid_side}")
    runs = [run_a, run_b]
    theta0 = _check_comparable(runs)
    gradients = [_vector(r, names.G0, "initial gradient g0") for r in runs]
    try:
        plane = plane_from_gradients(theta0, *gradients)
    except ValueError as error:  # the runs' own gradients, so the user's input
        raise DynamicsError(f"{run_a.path.name} and {run_b.path.name}: {error}") from None
    return plane, {r.name: _checkpoints(r) for r in runs}


def plane_views(
    run_a: Run,
    run_b: Run,
    surfaces: dict[str, LossSurface],
    grid_side: int = 41,
    margin: float = 0.25,
    progress: bool = False,
    distributed: bool = False,
) -> list[PlaneView]:
    """Both runs on the plane of their initial gradients, then each run's out-of-plane view.

    Args:
        run_a: the run whose normalized g0 is u.
        run_b: the run whose g0, Gram–Schmidt-ed against u, gives v.
        surfaces: ``{run name: LossSurface}`` of each run's own model on its probe batch.
        grid_side: grid points per axis (≥ 2).
        margin: extra fraction of the trajectories' range on each side of the grid.
        progress: progress bars over the grids.
        distributed: split every grid across the ranks of the initialized default process
            group (see :func:`evaluate_grid`); every rank returns the same views.

    Raises:
        DynamicsError: as :func:`initial_gradient_plane`.
    """
    runs = [run_a, run_b]
    plane, checkpoints = initial_gradient_plane(run_a, run_b, grid_side)

    on_plane = {
        r.name: _trajectory(r.name, plane, *checkpoints[r.name], surfaces[r.name]) for r in runs
    }
    grid = covering_grid(
        [(t.a, t.b) for t in on_plane.values()],
        num_alphas=grid_side,
        num_betas=grid_side,
        margin=margin,
    )
    views = [
        PlaneView(
            title=f"initial-gradient plane, loss of {r.name}",
            plane=plane,
            grid=grid,
            run=r.name,
            losses=evaluate_grid(
                surfaces[r.name], plane, grid, progress=progress, distributed=distributed
            ),
            trajectories=list(on_plane.values()),
            notes={f"in-plane share of ‖θT − θ0‖², {t.run}": _share(t) for t in on_plane.values()},
        )
        for r in runs
    ]
    for r in runs:
        steps, thetas = checkpoints[r.name]
        second, share = out_of_plane_view(plane, thetas[-1])
        trajectory = _trajectory(r.name, second, steps, thetas, surfaces[r.name])
        second_grid = covering_grid(
            [(trajectory.a, trajectory.b)],
            num_alphas=grid_side,
            num_betas=grid_side,
            margin=margin,
        )
        views.append(
            PlaneView(
                title=f"out-of-plane view of {r.name} (p̂, w)",
                plane=second,
                grid=second_grid,
                run=r.name,
                losses=evaluate_grid(
                    surfaces[r.name],
                    second,
                    second_grid,
                    progress=progress,
                    distributed=distributed,
                ),
                trajectories=[trajectory],
                notes={f"in-plane share of ‖θT − θ0‖², {r.name}": share},
            )
        )
    return views


def save_views(views: list[PlaneView], path: Path) -> None:
    """Store grids, losses, trajectories and basis metadata, so figures redraw without compute."""
    with h5py.File(path, "w") as file:
        for index, view in enumerate(views):
            group = file.create_group(f"view{index}")
            group.attrs.update(
                title=view.title,
                run=view.run,
                kind=view.plane.kind,
                metadata=json.dumps(dict(view.plane.metadata), default=_jsonable),
                notes=json.dumps(view.notes),
            )
            group["alphas"], group["betas"], group["losses"] = (
                view.grid.alphas,
                view.grid.betas,
                view.losses,
            )
            group["u"], group["v"] = view.plane.u, view.plane.v
            for t in view.trajectories:
                sub = group.create_group(f"trajectory/{t.run}")
                for name in ("step", "a", "b", "r", "loss", "plane_loss"):
                    sub[name] = getattr(t, name)


def _check_comparable(runs: list[Run]) -> np.ndarray:
    first, second = runs
    if not first.shares_theta0(second):
        raise DynamicsError(f"{first.path.name} and {second.path.name} do not share θ0")
    if first.layout != second.layout:
        raise DynamicsError(f"{first.path.name} and {second.path.name} differ in parameter layout")
    return _vector(first, names.THETA0, "θ0").astype(np.float64)


def _vector(run: Run, name: str, what: str) -> np.ndarray:
    value = run.vector(name)
    if value is None:
        raise DynamicsError(f"{run.path.name}: no {what} stored")
    return value


def _checkpoints(run: Run) -> tuple[np.ndarray, np.ndarray]:
    snapshots = run.recorded(names.SNAPSHOTS)
    if snapshots is None:
        raise DynamicsError(f"{run.path.name}: no parameter snapshots (ParameterDisplacement)")
    final = _vector(run, names.THETA_FINAL, "final parameters θT")
    loss = run.train_loss()
    last = (loss.step if loss is not None else snapshots.step)[-1] + 1
    return np.append(snapshots.step, last), np.vstack([snapshots[names.SNAPSHOT_THETA], final])


def _trajectory(
    run: str, plane: Plane, steps: np.ndarray, thetas: np.ndarray, surface: LossSurface
) -> Trajectory:
    a, b, r = project(plane, thetas)
    return Trajectory(
        run=run,
        step=steps,
        a=a,
        b=b,
        r=r,
        loss=np.array([surface.loss(theta) for theta in thetas]),
        plane_loss=np.array([surface.loss(plane.point(x, y)) for x, y in zip(a, b)]),
    )


def _share(trajectory: Trajectory) -> float:
    a, b, r = trajectory.a[-1], trajectory.b[-1], trajectory.r[-1]
    total = a * a + b * b + r * r
    return float((a * a + b * b) / total) if total > 0 else float("nan")


def _jsonable(value: object) -> object:
    return dict(value) if hasattr(value, "keys") else float(value)
