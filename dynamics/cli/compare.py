"""``dynamics compare``: runs beside the first, or groups of runs over seeds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dynamics.cli.common import (
    html_output_arguments,
    model_arguments,
    print_table,
    print_written,
    run_init_args,
)
from dynamics.cli.overrides import overrides_text
from dynamics.errors import DynamicsError


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``compare`` to ``commands``."""
    compare = commands.add_parser(
        "compare", help="compare runs with the first, or groups of runs over seeds"
    )
    compare.add_argument(
        "runs",
        type=Path,
        nargs="*",
        metavar="RUN.h5",
        help="the reference run, then runs (or directories) to compare; or one directory "
        "laid out as <variant>/seed<k>.h5 (one group per subfolder)",
    )
    compare.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a group of runs over seeds: a folder of seed<k>.h5 files or a glob; the first "
        "is the reference",
    )
    compare.add_argument(
        "--reference", metavar="NAME", help="the reference group (default: the first)"
    )
    compare.add_argument(
        "--json", action="store_true", help="groups: print the paired statistics as JSON"
    )
    html_output_arguments(compare, required=False)
    compare.add_argument(
        "--barrier-points",
        type=int,
        metavar="N",
        help="loss barriers: points along each straight line between θT's and from θ0 to θT, "
        "one forward pass on the probe batch each (default 21; 0: none)",
    )
    compare.add_argument(
        "--barrier-batch",
        type=Path,
        metavar="FILE",
        help="loss barriers: evaluate every line on this held-out batch instead of the runs' "
        "probe batches: a tensor, or dicts, lists and tuples of tensors, saved with torch.save "
        "(loaded with weights_only=True)",
    )
    model_arguments(compare)
    compare.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Compare run files with the first (a page), or groups (a table, and a page with -o)."""
    from dynamics.analysis.measures.seed_groups import is_group_directory

    grouped = args.group or (len(args.runs) == 1 and is_group_directory(args.runs[0]))
    if grouped:
        return _compare_groups(args)
    if args.reference or args.json:
        raise DynamicsError("--reference and --json go with groups (--group or a <variant>/ dir)")
    from dynamics.store import run_files

    if len(run_files(args.runs)) < 2:  # a folder counts its run files
        raise DynamicsError(
            "compare: two or more run files are required, or groups (--group NAME=PATH)"
        )
    if args.output is None:
        raise DynamicsError("compare: the argument -o/--output is required")
    from dynamics.analysis.measures.loss_barrier import POINTS, check_barrier_points

    barrier_points = POINTS if args.barrier_points is None else args.barrier_points
    check_barrier_points(barrier_points)  # before the barrier batch is read
    init_args = run_init_args(args.init_args)
    if args.model is not None and barrier_points:
        from dynamics.model.rebuild import model_target

        # The user's --model (a typo, a missing file) is their input, not a run's remark.
        model_target(args.model)
    from dynamics.analysis.pages.run_comparison import write_comparison

    barrier_batch = None
    if args.barrier_batch is not None:
        if not barrier_points:
            raise DynamicsError(
                "--barrier-batch: no loss barrier is evaluated with --barrier-points 0"
            )
        from dynamics.analysis.measures.loss_barrier import load_batch
        from dynamics.store import open_run

        # Its size is bounded by the runs' probe batches: they are opened (not read) first.
        runs = [open_run(path) for path in run_files(args.runs)]
        barrier_batch = load_batch(args.barrier_batch, runs)
    written = write_comparison(
        args.runs,
        args.output,
        args.overwrite,
        static_dir=args.static,
        static_format=args.static_format,
        barrier_points=barrier_points,
        model=args.model,
        init_args=init_args,
        trust_recorded_model=args.trust_recorded_model,
        barrier_batch=barrier_batch,
    )
    from dynamics.store import open_run

    _print_overrides([(str(path), open_run(path).config) for path in run_files(args.runs)])
    return print_written(written)


def _print_overrides(configs: list[tuple[str, dict | None]]) -> None:
    """A line per run (or group) with its recorded ``--set`` overrides, when any has some."""
    texts = [(label, overrides_text(config)) for label, config in configs]
    if any(text for _, text in texts):
        for label, text in texts:
            print(f"{label}: overrides: {text or 'none'}")


def _compare_groups(args: argparse.Namespace) -> int:
    from dynamics.analysis.measures.seed_groups import (
        compare_groups,
        directory_groups,
        groups_json,
        load_groups,
        parse_group,
    )
    from dynamics.analysis.pages.group_comparison import (
        STATISTICS_HEADER,
        STATISTICS_NOTE,
        statistics_rows,
        write_group_comparison,
    )

    if args.group and args.runs:
        raise DynamicsError("give either --group options or run files, not both")
    rebuilding = [
        option
        for option, given in (
            ("--barrier-points", args.barrier_points is not None),
            ("--barrier-batch", args.barrier_batch is not None),
            ("--model", args.model is not None),
            ("--init-args", bool(args.init_args)),
            ("--trust-recorded-model", args.trust_recorded_model),
        )
        if given
    ]
    if rebuilding:
        # Grouped compare draws no loss barrier, so these would be silently ignored.
        raise DynamicsError(f"{', '.join(rebuilding)}: only with run files, not with groups")
    specs = [parse_group(text) for text in args.group] or directory_groups(args.runs[0])
    if args.reference is not None:
        names = [name for name, _ in specs]
        if args.reference not in names:
            raise DynamicsError(f"--reference {args.reference}: no such group ({', '.join(names)})")
        specs.sort(key=lambda spec: spec[0] != args.reference)
    groups = load_groups(specs)
    comparisons = compare_groups(groups)
    written = None
    if args.output is not None:
        written = write_group_comparison(
            groups,
            comparisons,
            args.output,
            args.overwrite,
            static_dir=args.static,
            static_format=args.static_format,
        )
    if args.json:
        print(json.dumps(groups_json(groups, comparisons), indent=2))
        return 0
    for group in groups:
        print(f"{group.name}: seeds {', '.join(map(str, group.seeds))}")
    _print_overrides([(g.name, next(iter(g.runs.values())).config) for g in groups])
    print_table(STATISTICS_HEADER, statistics_rows(comparisons))
    print(STATISTICS_NOTE)
    return 0 if written is None else print_written(written)
