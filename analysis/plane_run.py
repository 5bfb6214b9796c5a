"""``dynamics plane`` as one call: two run files in, the plane views' page and data out.

Each run's model is rebuilt from its file; every grid is evaluated on one process or split
across several torch.distributed (gloo) processes, with the same result; one process writes.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dynamics.analysis.output import check_output
from dynamics.analysis.plane_report import write_plane_html
from dynamics.analysis.plane_views import initial_gradient_plane, plane_views, save_views
from dynamics.errors import DynamicsError
from dynamics.landscape import LossSurface
from dynamics.rebuild import probe_batch, rebuild_module
from dynamics.store import Run, open_run


@dataclass(frozen=True)
class PlaneWritten:
    """What :func:`write_plane` wrote.

    Attributes:
        html: the page of heatmaps and trajectories.
        results: the grids, losses, trajectories and bases (HDF5), beside the page.
        notes: ``{what: value}`` the views measured, e.g. each run's in-plane share of ‖θT − θ0‖².
    """

    html: Path
    results: Path
    notes: dict[str, float]


@dataclass(frozen=True)
class _Job:
    """Everything a process needs for its share; forked processes inherit it."""

    runs: list[Run]
    surfaces: dict[str, LossSurface]
    grid_side: int
    margin: float
    progress: bool
    html: Path
    results: Path


def write_plane(
    run_a: str | os.PathLike,
    run_b: str | os.PathLike,
    out_path: str | os.PathLike,
    overwrite: bool = False,
    *,
    grid_side: int = 41,
    margin: float = 0.25,
    processes: int = 1,
    progress: bool = False,
) -> PlaneWritten:
    """Both runs on the plane of their initial gradients and each out of it, as HTML and HDF5.

    Every input is checked before a model is rebuilt; see
    :func:`~dynamics.analysis.plane_views.plane_views` for the views.

    Args:
        run_a: the run whose initial gradient gives u.
        run_b: the run whose initial gradient gives v.
        out_path: the HTML file; the views' data go to the same name with ``.h5``.
        overwrite: replace existing outputs.
        grid_side: grid points per axis.
        margin: extra fraction of the trajectories' range on each side of a grid.
        processes: split every grid across this many processes (forked, gloo).
        progress: progress bars over the grids.

    Raises:
        DynamicsError: ``processes`` below 1, an output that may not be written, a run file
            that cannot be read, two runs that cannot share a plane (see
            :func:`~dynamics.analysis.plane_views.initial_gradient_plane`), a model that cannot
            be rebuilt, or a worker process that failed.
    """
    if processes < 1:
        raise DynamicsError(f"--processes must be at least 1, got {processes}")
    inputs = (run_a, run_b)
    html = check_output(out_path, overwrite, inputs)
    results = check_output(html.with_suffix(".h5"), overwrite, inputs)
    runs = [open_run(path) for path in inputs]
    initial_gradient_plane(*runs, grid_side)  # every input check before models are rebuilt
    surfaces = {
        run.name: LossSurface(rebuild_module(run), run.layout, probe_batch(run)) for run in runs
    }
    job = _Job(runs, surfaces, grid_side, margin, progress, html, results)
    if processes == 1:
        return PlaneWritten(html, results, _evaluate_share(0, job))
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
    return PlaneWritten(html, results, notes)


def _evaluate_share(
    rank: int, job: _Job, folder: Path | None = None, world_size: int = 1
) -> dict[str, float]:
    """One process's share of the grids; rank 0 writes the outputs and returns the notes.

    With ``folder`` (several processes), the processes meet through a file in it.
    """
    distributed = folder is not None
    if distributed:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # the processes split the machine's cores between them
        dist.init_process_group(
            "gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=world_size
        )
    try:
        views = plane_views(
            *job.runs, job.surfaces, job.grid_side, job.margin, job.progress, distributed
        )
    finally:
        if distributed:
            dist.destroy_process_group()
    if rank != 0:
        return {}
    write_plane_html(views, job.html)
    save_views(views, job.results)
    notes = {note: value for view in views for note, value in view.notes.items()}
    if distributed:  # the parent of forked processes sees no return value
        (folder / "notes.json").write_text(json.dumps(notes))
    return notes
