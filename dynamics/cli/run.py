"""``dynamics run``: train every variant of an experiment config."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from dynamics.cli.common import (
    INT64_MAX,
    add_launcher_arguments,
    check_range,
    launcher_flags,
    launcher_from_args,
    print_table,
)
from dynamics.cli.overrides import add_set_argument, set_overrides
from dynamics.errors import DynamicsError


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``run`` to ``commands``."""
    run = commands.add_parser("run", help="train every variant of an experiment config")
    run.add_argument(
        "config",
        type=Path,
        help="a YAML config file, or a shipped config by name (dynamics configs lists them)",
    )
    run.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for <variant>.h5 files (with seeds: <variant>/seed<k>.h5 and summary.json)",
    )
    run.add_argument("--steps", type=int, help="override the optimizer steps")
    seeds = run.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, help="override the variants' initialization seed")
    seeds.add_argument(
        "--seeds", metavar="0-4|0,2,3", help="train every variant for each of these seeds"
    )
    run.add_argument(
        "--jobs",
        type=int,
        help="with seeds: runs at a time, each in its own process (default: the cores); with "
        "a submitit launcher, jobs at a time (default: all)",
    )
    add_launcher_arguments(run)
    run.add_argument(
        "--reuse-finished",
        action="store_true",
        help="with seeds: read back each run a previous one finished with the same config "
        "instead of training it again (a run file with another config is refused)",
    )
    run.add_argument("--lr", type=float, help="override the learning rate")
    add_set_argument(run)
    run.add_argument("--overwrite", action="store_true", help="replace existing run files")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Train one seed of every variant, or every seed of a group (``--seeds``)."""
    from dynamics.experiments.config import parse_seeds
    from dynamics.experiments.config_files import load_config
    from dynamics.experiments.runner import run_experiment

    # load_config checks these overrides too, but names its config keys (optimizer.lr): they
    # stay here until it raises ParameterError for an override (FLAG_OF spells it).
    check_range("--steps", args.steps, 1, INT64_MAX)
    check_range("--seed", args.seed, 0, INT64_MAX)
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise DynamicsError(f"--lr must be a finite number > 0, got {args.lr}")
    seeds = None if args.seeds is None else parse_seeds(args.seeds, "--seeds")
    flags = {"steps": args.steps, "seed": args.seed, "seeds": seeds, "optimizer.lr": args.lr}
    experiment, config = load_config(args.config, **set_overrides(args.set, flags))
    if config.seeds is not None:
        return _run_seeds(args, experiment, config)  # run_seeds checks --jobs
    given = ["--jobs"] * (args.jobs is not None) + launcher_flags(args)
    given += ["--reuse-finished"] * args.reuse_finished
    if given:
        raise DynamicsError(f"{given[0]} goes with --seeds (or a config's seeds:)")
    results = run_experiment(experiment, config, args.out, args.overwrite, not args.no_progress)
    header = ("variant", experiment.setting, "final train loss", "final held-out loss", "run file")
    print_table(
        header,
        [
            (
                r.name,
                str(r.setting),
                f"{r.final_train_loss:.5g}",
                f"{r.final_heldout_loss:.5g}",
                str(r.path),
            )
            for r in results
        ],
    )
    print(f"all variants share θ0 (sha256 {results[0].theta0_sha256[:12]}…)")
    return 0


def _run_seeds(args: argparse.Namespace, experiment: Any, config: Any) -> int:
    from dynamics.experiments.seed_runs import SPREAD, run_seeds

    group = run_seeds(
        experiment,
        config,
        args.out,
        args.overwrite,
        args.jobs,
        not args.no_progress,
        launcher=launcher_from_args(args, args.out),
        reuse_finished=args.reuse_finished,
    )
    summary = group.summary
    seeds = summary["seeds"]
    print(f"{experiment.name}: {len(seeds)} seeds ({', '.join(map(str, seeds))}); {SPREAD}")
    rows = []
    for variant, entry in summary["variants"].items():
        for key, label in summary["figures"].items():
            stats = entry["figures"][key]
            rows.append(
                (
                    variant,
                    str(entry["setting"]),
                    label,
                    _mean_std(stats),
                    f"{_number(stats['min'])}–{_number(stats['max'])}",
                    *(_number(stats["per_seed"].get(str(s))) for s in seeds),
                )
            )
    header = ("variant", experiment.setting, "figure", "mean ± std", "min–max")
    print_table((*header, *(f"seed {s}" for s in seeds)), rows)
    for variant, entry in summary["crossover"].items():
        per_seed = [_number(entry["per_seed"].get(str(s))) for s in seeds]
        bracket = entry.get("bracket")
        where = _mean_std(entry)
        if bracket and bracket[1] - bracket[0] > 1:  # evaluations sparser than the steps
            where = f"{bracket[0]}–{bracket[1]} (between evaluations; interpolated {where})"
        print(
            f"{variant} overtakes {entry['baseline']} on held-out loss for good at step "
            f"{where} (per seed: {', '.join(per_seed)})"
        )
    print(f"wrote {group.summary_path}; runs in {args.out}/<variant>/seed<k>.h5")
    if group.failures:
        raise DynamicsError(
            f"{len(group.failures)} of {len(seeds) * len(summary['variants'])} runs failed "
            "(one line each above); the other runs' files are kept"
        )
    print("the variants of each seed share θ0 (checked by hash)")
    return 0


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.5g}"


def _mean_std(stats: dict) -> str:
    if stats["mean"] is None:
        return "-"
    std = "-" if stats["std"] is None else f"{stats['std']:.2g}"
    return f"{stats['mean']:.5g} ± {std}"
