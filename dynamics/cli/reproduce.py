"""``dynamics reproduce``: the paper's experiments over seeds, and the report of its claims."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from dynamics.cli.common import (
    INT64_MAX,
    add_launcher_arguments,
    check_range,
    launcher_from_args,
    print_table,
)
from dynamics.cli.overrides import add_set_argument, set_overrides
from dynamics.errors import DynamicsError


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``reproduce`` to ``commands``."""
    reproduce = commands.add_parser(
        "reproduce",
        help="the paper's experiments over seeds, compared, with a report of its claims",
    )
    reproduce.add_argument(
        "--quick",
        action="store_true",
        help="3 seeds and fewer steps per experiment (minutes, not half an hour)",
    )
    reproduce.add_argument(
        "--out", type=Path, default=Path("runs/reproduce"), help="default: runs/reproduce"
    )
    reproduce.add_argument(
        "--jobs", type=int, help="runs at a time, each in its own process (default: the cores)"
    )
    add_launcher_arguments(reproduce)
    reproduce.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    reproduce.add_argument(
        "--configs",
        type=Path,
        help="folder of the configs (default: the shipped configs, dynamics configs lists them)",
    )
    reproduce.add_argument(
        "--only",
        metavar="NAME,...",
        help="run only these experiments (teacher_student, autoencoder, char_gpt, vit_digits); "
        "the others' claims are 'not run'",
    )
    reproduce.add_argument(
        "--steps",
        type=int,
        help="every experiment trains this many steps, evaluating 10 times (a smoke test)",
    )
    reproduce.add_argument("--seeds", metavar="0-4|0,2,3", help="every experiment's seeds")
    reproduce.add_argument(
        "--no-sensitivity",
        action="store_true",
        help="leave out the sensitivity section (the controlled experiment in other setups)",
    )
    reproduce.add_argument("--no-progress", action="store_true", help="no line per run")
    add_set_argument(reproduce)
    reproduce.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Run the plan, print each claim's verdict and where the report went."""
    from dynamics.experiments.config import parse_seeds
    from dynamics.experiments.paper.reproduction_page import CLAIMS_HEADER, claim_rows
    from dynamics.experiments.paper.sensitivity import reading_statements
    from dynamics.experiments.paper.sensitivity_page import sensitivity_rows
    from dynamics.experiments.reproduce import reproduce
    from dynamics.system import available_cores

    check_range("--steps", args.steps, 1, INT64_MAX)
    # run_seeds checks jobs as well, but only after reproduce() has checked every output:
    # this check stays until reproduce() checks jobs first. A cluster's jobs are not this
    # machine's cores: the launcher checks its own.
    launcher = launcher_from_args(args, args.out)
    cores = available_cores()
    if launcher is None and args.jobs is not None and not 1 <= args.jobs <= cores:
        raise DynamicsError(
            f"--jobs must be from 1 to this machine's {cores} cores, got {args.jobs}"
        )
    seeds = None if args.seeds is None else parse_seeds(args.seeds, "--seeds")
    only = None if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    if only is not None and not only:
        raise DynamicsError("--only needs at least one experiment name")
    result = reproduce(
        args.out,
        quick=args.quick,
        jobs=args.jobs,
        overwrite=args.overwrite,
        configs=args.configs,
        only=only,
        steps=args.steps,
        seeds=seeds,
        sets=set_overrides(args.set),
        command=shlex.join(["dynamics", *args.argv]),
        progress=not args.no_progress,
        sensitivity=not args.no_sensitivity,
        launcher=launcher,
    )
    print_table(CLAIMS_HEADER, claim_rows(result.claims))
    if result.sensitivity:
        print("\nthe controlled experiment's verdicts in each setup (centre in brackets):")
        print_table(*sensitivity_rows(result.sensitivity))
        for line in reading_statements(result.sensitivity):
            print(f"- {line}")
    minutes, seconds = divmod(round(result.wall_s), 60)
    print(f"wall time {minutes} min {seconds} s")
    print(f"wrote {result.written.path} and {result.json_path}")
    if result.failures:
        raise DynamicsError(
            f"{len(result.failures)} runs failed (one line each above); their experiments' "
            "claims are 'not run', the other runs' files are kept"
        )
    return 0
