"""``dynamics overshoot``: per-layer hidden-state overshoot verdicts of a run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dynamics.cli.common import print_table
from dynamics.errors import DynamicsError


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``overshoot`` to ``commands``."""
    overshoot = commands.add_parser(
        "overshoot", help="per-layer hidden-state overshoot verdicts of a run"
    )
    overshoot.add_argument("run", type=Path, metavar="RUN.h5")
    overshoot.add_argument("--json", action="store_true", help="machine-readable output")
    overshoot.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Print the loss window and one row per layer (or the report as JSON)."""
    from dynamics.analysis.measures.run_series import run_overshoot
    from dynamics.store import open_run

    run = open_run(args.run)
    report = run_overshoot(run)
    if report is None:
        raise DynamicsError(
            f"{args.run}: no hidden_norms series; overshoot needs hidden-state norms "
            "(the HiddenStateNorms probe)"
        )
    if args.json:
        print(
            json.dumps({"run": str(args.run), "run_name": run.name, **report.to_dict()}, indent=2)
        )
        return 0
    window = report.loss_window
    if window is None:
        where = "no training loss recorded: no loss window"
    elif window.found:
        where = (
            f"fastest loss descent ({window.scale} loss): steps {window.start_step}.."
            f"{window.end_step}, steepest at {window.steepest_step}"
        )
    else:
        where = f"no loss window: {window.reason}"
    print(f"{args.run}  (run {run.name}); {where}")
    print_table(
        (
            "layer",
            "verdict",
            "signature",
            "peak step",
            "peak/plateau",
            "peak/start",
            "residual area",
            "reason",
        ),
        [
            (
                layer.name,
                layer.verdict,
                {None: "-", True: "yes", False: "no"}[layer.signature],
                "-" if layer.peak_step is None else f"{layer.peak_step:g}",
                "-" if layer.peak_over_plateau is None else f"{layer.peak_over_plateau:.4g}",
                "-" if layer.peak_over_start is None else f"{layer.peak_over_start:.4g}",
                "-" if layer.residual_area is None else f"{layer.residual_area:.4g}",
                layer.reason,
            )
            for layer in report.layers
        ],
    )
    return 0
