"""The ``dynamics`` command line.

Exit codes: 0 on success, 2 on bad input (one line on stderr, nothing a user has overwritten).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from dynamics.errors import DynamicsError

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print the whole usage; the contract is one line.
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dynamics`` console script."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except DynamicsError as error:
        print(f"dynamics: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("dynamics: interrupted", file=sys.stderr)
        return 130


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dynamics", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="train every variant of an experiment config")
    run.add_argument("config", type=Path, help="YAML config (see configs/teacher_student.yaml)")
    run.add_argument("--out", type=Path, required=True, help="folder for <variant>.h5 files")
    run.add_argument("--steps", type=int, help="override the optimizer steps")
    run.add_argument("--seed", type=int, help="override the students' initialization seed")
    run.add_argument("--lr", type=float, help="override the learning rate")
    run.add_argument("--overwrite", action="store_true", help="replace existing run files")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(handler=_run)

    info = commands.add_parser("info", help="summarize a run file")
    info.add_argument("run", type=Path)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(handler=_info)
    return parser


def _run(args: argparse.Namespace) -> int:
    from dynamics.experiments.config import load_config
    from dynamics.experiments.runner import run_teacher_student

    config = load_config(args.config, steps=args.steps, seed=args.seed, **{"optimizer.lr": args.lr})
    results = run_teacher_student(config, args.out, args.overwrite, not args.no_progress)
    rows = [("variant", "shift", "final train loss", "final held-out loss", "run file")]
    rows += [
        (
            r.name,
            str(r.shift),
            f"{r.final_train_loss:.5g}",
            f"{r.final_heldout_loss:.5g}",
            str(r.path),
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(f"all variants share θ0 (sha256 {results[0].theta0_sha256[:12]}…)")
    return 0


def _info(args: argparse.Namespace) -> int:
    from dynamics.store import open_run

    summary = open_run(args.run).summary()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    print(f"{summary['path']}  (run {summary['run_name']}, schema v{summary['schema_version']})")
    for group, info in summary["series"].items():
        shapes = ", ".join(f"{n}{tuple(s) if s else ''}" for n, s in info["series"].items())
        span = f"steps {info['first_step']}..{info['last_step']}" if info["rows"] else "empty"
        print(f"  {group:<18} {info['rows']:>7} rows  {span:<20} {shapes}")
    for name, shape in summary["vectors"].items():
        print(f"  vector {name:<11} {tuple(shape)}")
    config = summary["attrs"].get("config")
    if config:
        print(f"  config {json.dumps(config, sort_keys=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
