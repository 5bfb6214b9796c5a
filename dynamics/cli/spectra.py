"""``dynamics spectra``: the weight matrices' spectra of a run at its stored states."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dynamics.cli.common import html_output_arguments, print_table, print_written


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``spectra`` to ``commands``."""
    spectra = commands.add_parser(
        "spectra",
        help="weight matrices' spectral norm, stable rank and power-law α over stored states",
    )
    spectra.add_argument("run", type=Path, metavar="RUN.h5")
    spectra.add_argument("--json", action="store_true", help="machine-readable output")
    html_output_arguments(spectra, required=False)
    spectra.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Print one row per weight matrix at the last stored state (or JSON); with ``-o``, also
    write the page of every stored state."""
    from dynamics.analysis.measures.weight_spectra import weight_spectra
    from dynamics.analysis.output import check_output
    from dynamics.analysis.pages.sections.weight_spectra import write_spectra_page
    from dynamics.store import open_run

    if args.output is not None:  # checked before the run is read
        check_output(args.output, args.overwrite, [args.run])
    run = open_run(args.run)
    spectra = weight_spectra(run, last_only=True)
    if args.json:
        last = {"run": str(args.run), "run_name": run.name, "step": int(spectra.steps[-1])}
        print(json.dumps({**last, "matrices": spectra.last()}, indent=2))
    else:
        print(f"{args.run}  (run {run.name}); step {spectra.steps[-1]}, ΔW = Wt − W0")
        print_table(*spectra.table())
    if args.output is not None:
        written = write_spectra_page(
            args.run,
            args.output,
            args.overwrite,
            static_dir=args.static,
            static_format=args.static_format,
        )
        if args.json:  # stdout is the JSON document alone
            return 0
        return print_written(written)
    return 0
