"""``dynamics report``: one self-contained HTML page of run files."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynamics.cli.common import html_output_arguments, print_written


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``report`` to ``commands``."""
    report = commands.add_parser("report", help="self-contained HTML report of run files")
    report.add_argument(
        "runs", type=Path, nargs="+", metavar="RUN.h5", help="run files or directories of them"
    )
    html_output_arguments(report)
    report.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Write the report and say what it holds."""
    from dynamics.analysis.pages.run_report import write_report

    written = write_report(
        args.runs,
        args.output,
        args.overwrite,
        static_dir=args.static,
        static_format=args.static_format,
    )
    return print_written(written)
