"""``dynamics sweep``: one config over a grid of overrides, each cell a group of seeds,
compared and measured by the reproduction's claims."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynamics.cli.common import (
    INT64_MAX,
    add_launcher_arguments,
    check_range,
    launcher_from_args,
    print_table,
)
from dynamics.cli.overrides import add_set_argument, set_overrides
from dynamics.errors import DynamicsError, ParameterError


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``sweep`` to ``commands``."""
    sweep = commands.add_parser(
        "sweep",
        help="a config over a grid of overrides, every cell over seeds, with the claims per cell",
    )
    sweep.add_argument(
        "config",
        type=Path,
        help="a YAML config file, or a shipped config by name (dynamics configs lists them)",
    )
    sweep.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2",
        help="a grid axis: a config key and its values (repeat for more keys; the cells are "
        "every combination)",
    )
    sweep.add_argument("--seeds", required=True, metavar="0-4|0,2,3", help="every cell's seeds")
    sweep.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for sweep.json, sweep.html and cells/<cell>/ (runs, summary, compare.html)",
    )
    sweep.add_argument("--steps", type=int, help="override the optimizer steps")
    sweep.add_argument(
        "--jobs",
        type=int,
        help="runs at a time, each in its own process (default: the cores); with a submitit "
        "launcher, jobs at a time (default: all)",
    )
    add_set_argument(sweep)
    add_launcher_arguments(sweep)
    sweep.add_argument(
        "--overwrite",
        action="store_true",
        help="replace outputs of cells that are not complete (complete cells are reused)",
    )
    sweep.add_argument("--no-progress", action="store_true", help="no line per run and cell")
    sweep.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Check the grid, run the cells, print a table per claim and where the page went."""
    from dynamics.experiments.config import parse_seeds
    from dynamics.experiments.overrides import parse_choices
    from dynamics.experiments.paper.sweep_page import CELL_CLAIM_HEADER, cell_claim_rows
    from dynamics.experiments.sweep import grid_cells, run_cells

    check_range("--steps", args.steps, 1, INT64_MAX)
    seeds = parse_seeds(args.seeds, "--seeds")
    grid: dict = {}
    for text in args.grid:
        key, values = _flagged(parse_choices, text, "grid")
        if key in grid:
            raise DynamicsError(f"--grid {key} is given twice; give each key once")
        grid[key] = values
    shared = set_overrides(args.set, {"steps": args.steps})  # what every cell shares
    both = next((key for key in grid if key in shared), None)
    if both is not None:
        raise DynamicsError(f"{both} is both in --grid and in --set or --steps; give it once")
    result = run_cells(
        args.config,
        grid_cells(grid),
        args.out,
        seeds=seeds,
        jobs=args.jobs,
        launcher=launcher_from_args(args, args.out),
        overwrite=args.overwrite,
        progress=not args.no_progress,
        base_overrides=shared,
        command=shlex.join(["dynamics", *args.argv]),
    )
    for claim in result.data["claims"]:
        print(f"{claim['key']}: {claim['figure']} ({claim['criterion']})")
        print_table(CELL_CLAIM_HEADER, cell_claim_rows(result.cells, claim["key"]))
        print()
    print(f"wall time {result.wall_s:.1f} s")
    print(f"wrote {result.page_path} and {result.json_path}")
    if result.failed:
        raise DynamicsError(
            f"{len(result.failed)} of {len(result.cells)} cells failed (one line each above); "
            "the other cells are complete"
        )
    return 0


def _flagged(parse: Callable[..., Any], text: str, parameter: str) -> Any:
    """``parse(text, parameter=parameter)``, its error naming the flag (``--grid``)."""
    try:
        return parse(text, parameter=parameter)
    except ParameterError as error:
        raise DynamicsError(error.naming(f"--{parameter}")) from None
