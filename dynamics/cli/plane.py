"""``dynamics plane``: loss heatmaps on the initial-gradient plane, and each run out of it."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynamics.cli.common import model_arguments, run_init_args


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``plane`` to ``commands``."""
    plane = commands.add_parser(
        "plane", help="loss heatmaps on the initial-gradient plane and the out-of-plane view"
    )
    plane.add_argument("run_a", type=Path, help="run whose initial gradient gives u")
    plane.add_argument("run_b", type=Path, help="run whose initial gradient gives v")
    plane.add_argument(
        "--plane",
        dest="plane_kind",
        default="auto",
        choices=("auto", "gradients", "gradient-endpoints", "pca", "random"),
        help="default auto: the initial gradients' plane, or if they coincide g0 and the "
        "endpoints' direction",
    )
    plane.add_argument("-o", "--output", type=Path, required=True, help="HTML file to write")
    plane.add_argument("--grid", type=int, default=41, help="grid points per axis (default 41)")
    plane.add_argument(
        "--span",
        type=float,
        default=0.25,
        help="margin around the trajectories, as a fraction of their range (0 to 100)",
    )
    plane.add_argument(
        "--coarse",
        type=int,
        metavar="N",
        help="coarse to fine: an N×N grid first, then --grid points only near the trajectories",
    )
    plane.add_argument("--overwrite", action="store_true", help="replace an existing output")
    plane.add_argument("--no-progress", action="store_true", help="no progress bars")
    plane.add_argument(
        "--processes",
        type=int,
        help="split each grid across this many processes (default: the available cores)",
    )
    model_arguments(plane)
    plane.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Write the plane's page and grids; print its remarks and notes."""
    from dynamics.analysis.pages.plane import write_plane

    init_args = run_init_args(args.init_args)
    written = write_plane(
        args.run_a,
        args.run_b,
        args.output,
        args.overwrite,
        plane=args.plane_kind,
        grid_side=args.grid,
        margin=args.span,
        coarse=args.coarse,
        processes=args.processes,
        progress=not args.no_progress,
        model=args.model,
        init_args=init_args,
        trust_recorded_model=args.trust_recorded_model,
    )
    for remark in written.remarks:
        print(remark)
    for note, value in written.notes.items():
        print(f"{note}: {value:.4f}")
    print(f"wrote {written.html} (grids and trajectories in {written.results})")
    return 0
