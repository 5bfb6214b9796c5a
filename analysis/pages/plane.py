"""``dynamics plane`` as one call: two run files in, the plane views' page and data out.

A run's views come from what it evaluated in its training process at the end of fit
(``GradientPlane(at_end=True)``) when it did so on the chosen plane; otherwise its model is
rebuilt from its file (:mod:`dynamics.analysis.measures.rebuilt_loss`). Every grid is evaluated
on one process or split across several torch.distributed (gloo) processes, with the same result;
one process writes, each chunk of rows as it is finished, so an interrupted evaluation keeps
them. The views are planned and evaluated by :mod:`dynamics.analysis.measures.plane_grid` and
drawn by :mod:`dynamics.analysis.figures.plane`.
"""

from __future__ import annotations

import html as html_text
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from dynamics import __version__
from dynamics.analysis.figures.plane import checkpoint_loss_figure, heatmap_figure
from dynamics.analysis.measures.plane_grid import (
    ChosenPlane,
    StoredViews,
    check_plane_settings,
    choose_plane,
    evaluate_views,
    plane_label,
    planned_views,
    points_to_evaluate,
    stored_views,
    views_file,
)
from dynamics.analysis.measures.rebuilt_loss import rebuilt_surface
from dynamics.analysis.output import PLANE_GRID_SCHEMA, check_output, claimed
from dynamics.analysis.pages.page import Written, figure_html, html_page, html_table, write_page
from dynamics.errors import DynamicsError
from dynamics.geometry.landscape import LossSurface, PlaneView
from dynamics.model.rebuild import MissingInitArgs, RunInitArgs, run_init_args
from dynamics.store import Run, names, open_run
from dynamics.system import available_cores

__all__ = ["PlaneWritten", "grid_path", "write_plane", "write_plane_html"]


@dataclass(frozen=True)
class PlaneWritten:
    """What :func:`write_plane` wrote.

    Attributes:
        html: the page of heatmaps and trajectories.
        results: the grids, losses, trajectories and bases (HDF5), beside the page.
        notes: ``{what: value}`` the views measured, e.g. each run's in-plane share of ‖θT − θ0‖².
        remarks: how the plane was chosen, and anything that could not be drawn and why.
    """

    html: Path
    results: Path
    notes: dict[str, float]
    remarks: list[str]


@dataclass(frozen=True)
class _Job:
    """Everything a process needs for its share; forked processes inherit it."""

    runs: list[Run]
    chosen: ChosenPlane
    surfaces: dict[str, LossSurface]
    stored: dict[str, StoredViews]
    grid_side: int
    margin: float
    coarse: int | None
    progress: bool
    html: Path
    results: Path
    remarks: list[str]


def write_plane(
    run_a: str | os.PathLike,
    run_b: str | os.PathLike,
    out_path: str | os.PathLike,
    overwrite: bool = False,
    *,
    plane: str = "auto",
    grid_side: int = 41,
    margin: float = 0.25,
    coarse: int | None = None,
    processes: int | None = None,
    progress: bool = False,
    model: str | None = None,
    init_args: dict | RunInitArgs | None = None,
    trust_recorded_model: bool = False,
) -> PlaneWritten:
    """Both runs on a plane and each out of it, as HTML and HDF5.

    Every input is checked before a model is rebuilt; see
    :func:`~dynamics.analysis.measures.plane_grid.choose_plane` for the planes and
    :func:`~dynamics.analysis.measures.plane_grid.planned_views` for the views.

    Args:
        run_a: the first run (its initial gradient gives u on the gradient planes).
        run_b: the second run.
        out_path: the HTML file; the views' data go beside it, to :func:`grid_path` of it.
        overwrite: replace existing outputs.
        plane: one of :data:`~dynamics.analysis.measures.plane_grid.PLANE_CHOICES`.
        grid_side: grid points per axis.
        margin: extra fraction of the trajectories' range on each side of a grid.
        coarse: coarse to fine: a ``coarse``×``coarse`` grid over each view first, then the
            ``grid_side`` points only near the trajectories (see
            :func:`~dynamics.analysis.measures.plane_grid.planned_views`).
        processes: split every grid across this many processes (forked, gloo); default: the
            cores this process may use.
        progress: one progress bar, with an estimate of the time left, over every evaluation.
        model: build each run's model with this class or factory instead of the recorded
            class (see :func:`~dynamics.model.rebuild.rebuild_module`).
        init_args: init args overriding the recorded ones for both runs (a mapping), or each
            run's own, which also complete the ones it did not record
            (:class:`~dynamics.model.rebuild.RunInitArgs`).
        trust_recorded_model: import a recorded class from outside the installed packages
            (see :func:`~dynamics.model.rebuild.rebuild_module`).

    Raises:
        ParameterError: a setting that cannot work, before anything is read
            (:func:`~dynamics.analysis.measures.plane_grid.check_plane_settings`).
        DynamicsError: an output that may not be written (or that
            another process is writing: the outputs are claimed until written), a run file
            that cannot be read, two runs that cannot share the plane asked for, a model that
            cannot be rebuilt (unless the other run stored its views in training: then the
            page says which heatmaps are missing and why), or a worker process that failed.

    Example::

        written = write_plane("runs/demo/unshifted.h5", "runs/demo/shifted.h5",
                              "runs/demo/plane.html", grid_side=21, processes=1)
        print(written.notes)  # each run's in-plane share of ‖θT − θ0‖²
    """
    check_plane_settings(plane, grid_side, margin, coarse, processes)
    processes = available_cores() if processes is None else processes
    inputs = (run_a, run_b)
    html = check_output(out_path, overwrite, inputs)
    results = check_output(grid_path(html), overwrite, inputs, kind=PLANE_GRID_SCHEMA)
    with claimed([html, results]):  # until written: a second plane to them is refused
        runs = [open_run(path) for path in inputs]
        init_args = run_init_args(init_args, inputs)
        # every input check before models are rebuilt
        chosen = choose_plane(*runs, plane, grid_side)
        stored = {r.name: s for r in runs if (s := stored_views(r, chosen.plane)) is not None}
        surfaces, remarks = {}, [f"plane: {chosen.reason}"]
        remarks += [
            f"{note}: its trajectory ends at its last finite checkpoint; no out-of-plane view"
            for note in chosen.diverged.values()
        ]
        for run in runs:
            if run.name in stored:
                continue
            try:
                surfaces[run.name] = rebuilt_surface(run, model, init_args, trust_recorded_model)
            except MissingInitArgs:
                raise  # the user's input to complete, even where the other run stored its views
            except DynamicsError as error:
                if not stored:
                    raise DynamicsError(
                        f"{error}{_stored_elsewhere(runs, plane, grid_side)}"
                    ) from None
                remarks.append(f"no heatmaps of {run.name}: {error}")
        job = _Job(
            runs,
            chosen,
            surfaces,
            stored,
            grid_side,
            margin,
            coarse,
            progress,
            html,
            results,
            remarks,
        )
        if processes == 1 or not surfaces:
            return PlaneWritten(html, results, _evaluate_share(0, job), remarks)
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as folder:
            try:  # fork: the workers share the rebuilt models and read the runs themselves
                mp.start_processes(
                    _evaluate_share,
                    args=(job, Path(folder), processes),
                    nprocs=processes,
                    start_method="fork",
                )
            except mp.ProcessRaisedException as error:
                last = str(error).strip().splitlines()[-1]
                raise DynamicsError(f"plane evaluation failed in a worker: {last}") from None
            notes = json.loads((Path(folder) / "notes.json").read_text())
        return PlaneWritten(html, results, notes, remarks)


def grid_path(html: Path) -> Path:
    """Where ``dynamics plane -o html`` writes its grids: ``X.plane.h5`` beside ``X.html``.

    Not ``X.h5``: that name is a run file's, and ``-o runs/C.html`` would replace ``runs/C.h5``.

    Example::

        grid_path(Path("runs/plane.html"))  # Path('runs/plane.plane.h5')
    """
    return html.with_suffix(".plane.h5")


def _stored_elsewhere(runs: list[Run], plane: str, grid_side: int) -> str:
    """Where the runs' stored views are, when none is on the plane asked for: on the same
    plane with the runs swapped (a partner run's g0 is u), or on another plane."""
    elsewhere = [r.name for r in runs if names.PLANE_END_STEPS in r.vector_names]
    if not elsewhere:
        return ""
    swapped = choose_plane(*reversed(runs), plane, grid_side).plane
    if any(stored_views(r, swapped) is not None for r in runs):
        first, second = (r.path for r in reversed(runs))
        return (
            f"; {', '.join(elsewhere)} stored views on this plane with the runs in the other "
            f"order: dynamics plane {first} {second}"
        )
    return f"; {', '.join(elsewhere)} stored views on another plane"


def _evaluate_share(
    rank: int, job: _Job, folder: Path | None = None, world_size: int = 1
) -> dict[str, float]:
    """One process's share of the grids; rank 0 writes the outputs and returns the notes.

    With ``folder`` (several processes), the processes meet through a file in it.
    """
    if folder is None:
        return _evaluate(rank, job, folder)
    import torch

    from dynamics import world

    torch.set_num_threads(1)  # the processes split the machine's cores between them
    with world.process_group(rank, world_size, folder / "rendezvous"):
        return _evaluate(rank, job, folder)


def _evaluate(rank: int, job: _Job, folder: Path | None) -> dict[str, float]:
    distributed = folder is not None
    trajectory_points = sum(4 * len(job.chosen.checkpoints[name][0]) for name in job.surfaces)
    total = trajectory_points + 2 * job.grid_side**2 * len(job.surfaces)
    bar = tqdm(
        total=total, unit="pt", desc="plane losses", disable=not job.progress or rank or not total
    )
    try:
        views = planned_views(
            job.runs,
            job.chosen,
            job.surfaces,
            job.stored,
            job.grid_side,
            job.margin,
            bar,
            job.coarse,
        )
        bar.total = trajectory_points + points_to_evaluate(views)
        bar.refresh()
        if rank == 0:
            with views_file(views, job.results, job.remarks) as write_rows:
                views = evaluate_views(views, job.surfaces, bar, distributed, write_rows)
        else:
            views = evaluate_views(views, job.surfaces, None, distributed)
    finally:
        bar.close()
    if rank != 0:
        return {}
    views = [  # where the heatmap's buffers switch, for the figure to mark
        replace(v, buffer_regions=job.surfaces[v.run].buffer_regions(v.plane, v.grid))
        if v.run in job.surfaces and v.source.startswith("offline")
        else v
        for v in views
    ]
    write_plane_html(views, job.html, job.remarks)
    notes = {note: value for view in views for note, value in view.notes.items()}
    if distributed:  # the parent of forked processes sees no return value
        (folder / "notes.json").write_text(json.dumps(notes))
    return notes


def write_plane_html(
    views: list[PlaneView],
    out: Path,
    remarks: list[str] = (),
    *,
    static_dir: str | os.PathLike | None = None,
    static_format: str = "png",
    overwrite: bool = False,
) -> Written:
    """A self-contained HTML page (plotly.js embedded once) of ``views``, written atomically.

    The caller checks ``out`` first (:func:`dynamics.analysis.output.check_output`), before the
    grids are computed.

    Args:
        views: the plane views, evaluated (see :mod:`dynamics.analysis.measures.plane_grid`).
        out: the HTML file.
        remarks: lines shown above the figures (how the plane was chosen, what is missing).
        static_dir: also export both figures into this folder (see
            :func:`dynamics.analysis.pages.page.write_page`).
        static_format: ``"png"`` or ``"svg"``.
        overwrite: replace existing static files.

    Returns:
        What was written.

    Example::

        views = planned_views(...)  # evaluated, see dynamics.analysis.measures.plane_grid
        write_plane_html(views, Path("plane.html"), ["plane: the initial-gradient plane"])
    """
    notes = {k: v for view in views for k, v in view.notes.items()}
    figures = [
        ("plane-heatmaps", heatmap_figure(views)),
        ("plane-checkpoint-loss", checkpoint_loss_figure(views)),
    ]
    first = next((v.plane for v in views if v.plane.kind != "out-of-plane"), None)
    heading = plane_label(first) if first is not None else "plane"
    body = "".join(
        [
            f"<h1>{html_text.escape(heading[0].upper() + heading[1:])} and out-of-plane views</h1>",
            f"<p class='meta'>{html_text.escape(', '.join(dict.fromkeys(v.run for v in views)))}"
            f" · dynamics {__version__}</p>",
            *(f"<p class='note'>{html_text.escape(remark)}</p>" for remark in remarks),
            "<h2>Loss landscapes</h2>",
            "<p class='note'>Each panel: log10 of the loss of the run it names, on that run's "
            "stored probe batch, at θ0 + a·u + b·v; every run's path is drawn over it. Circles "
            "mark θ0, stars θT.</p>",
            html_table(("heatmap", "evaluated"), [(v.title, v.source) for v in views]),
            *(
                f"<p class='note'>Buffers: {html_text.escape(note)}.</p>"
                for note in dict.fromkeys(v.buffers for v in views if v.buffers)
            ),
            figure_html(figures[0][1], 0),
            "<h2>Real checkpoints against the plane</h2>",
            figure_html(figures[1][1], 1),
            "<h2>Notes</h2>",
            html_table(("note", "value"), sorted(notes.items())),
        ]
    )
    page = html_page("dynamics plane views", body)
    return write_page(Path(out), page, figures, static_dir, static_format, overwrite)
