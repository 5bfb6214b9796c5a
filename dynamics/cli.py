"""The ``dynamics`` command line.

Exit codes: 0 on success, 2 on bad input (one line on stderr, nothing a user has overwritten)
or output that cannot be written (a full disk), 130 on Ctrl-C (one line), 141 when a reader
stops early (``| head``).
Every option is checked before any file is read or created.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from dynamics.errors import DynamicsError

if TYPE_CHECKING:
    from dynamics.analysis.pages.page import Written
    from dynamics.bias.audit_result import AuditResult
    from dynamics.model.rebuild import RunInitArgs

USAGE_ERROR = 2
#: A shell's status of a command stopped by Ctrl-C (128 + SIGINT).
INTERRUPTED = 130
#: A shell's status of a command whose reader went away (128 + SIGPIPE).
BROKEN_PIPE = 141
#: The largest seed or step count: what a 64-bit signed integer holds.
_INT64_MAX = 2**63 - 1
#: The largest ``--span``: a grid 201 times the trajectories' range already shows them as a dot.
_MAX_SPAN = 100.0
#: Float64 arrays a plane grid point costs at least: the losses of two views per run, and the
#: coordinates of a mesh.
_GRID_ARRAYS = 6
#: The most points along a loss-barrier line: each is a forward pass; finer shows nothing new.
_MAX_BARRIER_POINTS = 1001
_DEFAULT_BARRIER_POINTS = 21


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print the whole usage; the contract is one line.
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dynamics`` console script."""
    stdout, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:  # parsing too: Ctrl-C while the parser loads is one line like any other
        args = _build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, as reports show
        code = args.handler(args)
        sys.stdout.flush()  # a full disk fails here, not in the interpreter's exit
        return code
    except DynamicsError as error:
        print(f"dynamics: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("dynamics: interrupted", file=sys.stderr)
        return INTERRUPTED
    except _StdoutFailed as failed:
        _discard(stdout)
        if isinstance(failed.error, BrokenPipeError):
            return BROKEN_PIPE  # the reader has what it wanted (| head): nothing to report
        print(f"dynamics: error: cannot write the output: {failed.error.strerror}", file=sys.stderr)
        return USAGE_ERROR
    finally:
        sys.stdout = stdout


class _StdoutFailed(Exception):
    """Standard output could not be written; ``error`` says why."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Stdout:
    """Standard output whose write errors are told apart from every other OSError."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            raise _StdoutFailed(error) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise _StdoutFailed(error) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _discard(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null: Python flushes what it still holds at exit,
    and that flush must not fail again with a traceback."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError):  # not a real file (a test's captured output)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dynamics", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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
        help="with seeds: runs at a time, each in its own process (default: the cores)",
    )
    run.add_argument("--lr", type=float, help="override the learning rate")
    run.add_argument("--overwrite", action="store_true", help="replace existing run files")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(handler=_run)

    configs = commands.add_parser("configs", help="list the shipped configs dynamics run names")
    configs.set_defaults(handler=_configs)

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
    reproduce.add_argument("--no-progress", action="store_true", help="no line per run")
    reproduce.set_defaults(handler=_reproduce)

    info = commands.add_parser("info", help="summarize a run file")
    info.add_argument("run", type=Path)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(handler=_info)

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
    _model_arguments(plane)
    plane.set_defaults(handler=_plane)

    report = commands.add_parser("report", help="self-contained HTML report of run files")
    report.add_argument(
        "runs", type=Path, nargs="+", metavar="RUN.h5", help="run files or directories of them"
    )
    _html_output_arguments(report)
    report.set_defaults(handler=_report)

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
    _html_output_arguments(compare, required=False)
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
    _model_arguments(compare)
    compare.set_defaults(handler=_compare)

    overshoot = commands.add_parser(
        "overshoot", help="per-layer hidden-state overshoot verdicts of a run"
    )
    overshoot.add_argument("run", type=Path, metavar="RUN.h5")
    overshoot.add_argument("--json", action="store_true", help="machine-readable output")
    overshoot.set_defaults(handler=_overshoot)

    audit = commands.add_parser(
        "audit",
        help="bias parameters, origin, absorption, shift sources and activation bias of a model",
    )
    audit.add_argument(
        "target",
        metavar="MODEL|RUN.h5",
        help="a model class or factory (pkg.module:Class, path/to/file.py:Class or "
        "pkg.module.Class), or a run file (its recorded model at θ0)",
    )
    audit.add_argument(
        "--init-args",
        metavar="JSON",
        help="the class's init args (completing a run's recorded ones)",
    )
    audit.add_argument(
        "--input-shape",
        metavar="N,...",
        help="example input: an N(0, 1) batch of this shape, e.g. 8,784 (default for a run "
        "file: its stored probe batch, when it has one)",
    )
    audit.add_argument(
        "--vocab",
        type=int,
        metavar="V",
        help="with --input-shape: token ids drawn uniformly from 0..V-1 instead (language models)",
    )
    audit.add_argument(
        "--input-json",
        metavar="JSON",
        help='example input as JSON: an object of keyword arguments, e.g. \'{"input_ids": '
        "[[1, 2, 3]]}' (Hugging Face models), or an array, the one argument; integers stay "
        "integers, other numbers take the model's dtype",
    )
    audit.add_argument(
        "--input-file",
        type=Path,
        metavar="FILE",
        help="example input saved with torch.save (loaded with weights_only=True): a dict is "
        "keyword arguments, a list or tuple positional arguments, a tensor the one argument",
    )
    audit.add_argument(
        "--draws", type=int, help="random weight draws of the origin check (default 5)"
    )
    audit.add_argument("--json", action="store_true", help="machine-readable output")
    audit.add_argument(
        "--model",
        metavar="MODULE:NAME",
        help="with a run file: build its model with this class or factory instead",
    )
    audit.add_argument(
        "--trust-recorded-model",
        action="store_true",
        help="with a run file: import its recorded class even from outside the installed packages",
    )
    audit.set_defaults(handler=_audit)
    return parser


def _html_output_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("-o", "--output", type=Path, required=required, help="HTML file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument(
        "--static",
        type=Path,
        metavar="DIR",
        help="also export each figure into DIR (needs kaleido and a Chromium)",
    )
    parser.add_argument(
        "--static-format", choices=("png", "svg"), default="png", help="default: png"
    )


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """How a run's model is rebuilt offline (see :func:`dynamics.model.rebuild.rebuild_module`)."""
    parser.add_argument(
        "--model",
        metavar="MODULE:NAME",
        help="build the model with this class or factory (pkg.module:name or "
        "path/to/file.py:name) instead of the recorded class",
    )
    parser.add_argument(
        "--init-args",
        action="append",
        default=[],
        metavar="[RUN.h5=]JSON",
        help="a run's init args (RUN.h5=JSON, once per run), completing or overriding its "
        "recorded ones; JSON alone: every run's, overriding only (args a run did not record "
        "may differ between runs, so each run's are given by name)",
    )
    parser.add_argument(
        "--trust-recorded-model",
        action="store_true",
        help="import the runs' recorded model class even from outside the installed packages "
        "(e.g. the working directory's modules); importing runs that module's code",
    )


def _check_range(option: str, value: float | None, low: float, high: float) -> None:
    """Refuse ``value`` (None: not given) outside ``[low, high]``, or not finite."""
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise DynamicsError(f"{option} must be a number from {low} to {high}, got {value}")


def _run(args: argparse.Namespace) -> int:
    from dynamics.experiments.config import parse_seeds
    from dynamics.experiments.config_files import load_config
    from dynamics.experiments.runner import run_experiment
    from dynamics.system import available_cores

    _check_range("--steps", args.steps, 1, _INT64_MAX)
    _check_range("--seed", args.seed, 0, _INT64_MAX)
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise DynamicsError(f"--lr must be a finite number > 0, got {args.lr}")
    seeds = None if args.seeds is None else parse_seeds(args.seeds, "--seeds")
    cores = available_cores()
    if args.jobs is not None and not 1 <= args.jobs <= cores:
        raise DynamicsError(
            f"--jobs must be from 1 to this machine's {cores} cores, got {args.jobs}"
        )

    experiment, config = load_config(
        args.config, steps=args.steps, seed=args.seed, seeds=seeds, **{"optimizer.lr": args.lr}
    )
    if config.seeds is not None:
        return _run_seeds(args, experiment, config)
    if args.jobs is not None:
        raise DynamicsError("--jobs goes with --seeds (or a config's seeds:)")
    results = run_experiment(experiment, config, args.out, args.overwrite, not args.no_progress)
    header = ("variant", experiment.setting, "final train loss", "final held-out loss", "run file")
    _print_table(
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


def _configs(args: argparse.Namespace) -> int:
    from dynamics.experiments.config_files import configs_folder, shipped_configs

    rows = [(c.name, c.experiment, c.description) for c in shipped_configs().values()]
    _print_table(("name", "experiment", "what it is"), rows)
    print(f"files in {configs_folder()}: copy one to change it, or run one by name")
    return 0


def _run_seeds(args: argparse.Namespace, experiment: Any, config: Any) -> int:
    from dynamics.experiments.seed_runs import SPREAD, run_seeds

    group = run_seeds(experiment, config, args.out, args.overwrite, args.jobs, not args.no_progress)
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
    _print_table((*header, *(f"seed {s}" for s in seeds)), rows)
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


def _reproduce(args: argparse.Namespace) -> int:
    import shlex

    from dynamics.experiments.config import parse_seeds
    from dynamics.experiments.paper.reproduction_page import CLAIMS_HEADER, claim_rows
    from dynamics.experiments.reproduce import reproduce
    from dynamics.system import available_cores

    _check_range("--steps", args.steps, 1, _INT64_MAX)
    cores = available_cores()
    if args.jobs is not None and not 1 <= args.jobs <= cores:
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
        command=shlex.join(["dynamics", *args.argv]),
        progress=not args.no_progress,
    )
    _print_table(CLAIMS_HEADER, claim_rows(result.claims))
    minutes, seconds = divmod(round(result.wall_s), 60)
    print(f"wall time {minutes} min {seconds} s")
    print(f"wrote {result.written.path} and {result.json_path}")
    if result.failures:
        raise DynamicsError(
            f"{len(result.failures)} runs failed (one line each above); their experiments' "
            "claims are 'not run', the other runs' files are kept"
        )
    return 0


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.5g}"


def _mean_std(stats: dict) -> str:
    if stats["mean"] is None:
        return "-"
    std = "-" if stats["std"] is None else f"{stats['std']:.2g}"
    return f"{stats['mean']:.5g} ± {std}"


def _info(args: argparse.Namespace) -> int:
    from dynamics.store import open_run

    summary = open_run(args.run).summary()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    print(f"{summary['path']}  (run {summary['run_name']}, schema v{summary['schema_version']})")
    print(f"  status {_status_line(summary['status'])}")
    if summary["diverged_at"] is not None:
        print(f"  diverged at step {summary['diverged_at']}: its loss or parameters not finite")
    for event in summary["events"]:
        print(f"  event  step {event['step']} {event['probe']} {event['kind']}: {event['message']}")
    for group, info in summary["series"].items():
        shapes = ", ".join(f"{n}{tuple(s) if s else ''}" for n, s in info["series"].items())
        span = f"steps {info['first_step']}..{info['last_step']}" if info["rows"] else "empty"
        print(f"  {group:<18} {info['rows']:>7} rows  {span:<20} {shapes}")
    snapshots = _snapshot_line(summary)
    if snapshots:
        print(f"  snapshots {snapshots}")
    for name, shape in summary["vectors"].items():
        print(f"  vector {name:<11} {tuple(shape)}")
    config = summary["attrs"].get("config")
    if config:
        print(f"  config {json.dumps(config, sort_keys=True)}")
    return 0


def _snapshot_line(summary: dict) -> str:
    """``19 of θ (every 11 steps, 3.6 MiB; default budget 4 MiB)``: what `plane` can draw
    from; empty for a run without ParameterDisplacement's plan."""
    from dynamics.store import names

    probes = summary["attrs"].get(names.ATTR_PROBES)
    plans = [
        probe.get("settings", {}).get("snapshots")
        for probe in (probes if isinstance(probes, list) else [])
        if isinstance(probe, dict) and isinstance(probe.get("settings"), dict)
    ]
    plan = next((p for p in plans if isinstance(p, dict)), None)
    if plan is None:
        return ""
    count = summary["series"].get(names.SNAPSHOTS, {}).get("rows", 0)
    if not count:
        return "0 of θ (θ0 and θT only)"
    bytes_each = plan.get("bytes_each") or 0
    budget = plan.get("budget_mb")
    kind = "default budget" if plan.get("budget") == "default" else "budget"
    limit = f"; {kind} {budget:g} MiB" if isinstance(budget, (int, float)) else ""
    return (
        f"{count} of θ (every {plan.get('period')} steps, "
        f"{count * bytes_each / 2**20:.1f} MiB{limit})"
    )


def _status_line(status: dict) -> str:
    """``finished at step 1999 after 93.2 s``, ``crashed (ValueError: ...)``, ..."""
    line = status["state"]
    if status["exception"]:
        line += f" ({status['exception']})"
    if status["last_step"] is not None:
        line += f", last flushed step {status['last_step']}"
    if status["wall_time_s"] is not None:
        line += f", {status['wall_time_s']:.1f} s"
    return line


def _plane(args: argparse.Namespace) -> int:
    from dynamics.analysis.pages.plane import write_plane
    from dynamics.system import check_fits

    if args.grid < 2:
        raise DynamicsError(f"--grid must be at least 2, got {args.grid}")
    check_fits(f"--grid {args.grid}", _GRID_ARRAYS * 8 * args.grid**2)
    if args.coarse is not None and not 2 <= args.coarse <= args.grid:
        raise DynamicsError(
            f"--coarse must be between 2 and --grid ({args.grid}), got {args.coarse}"
        )
    _check_range("--span", args.span, 0, _MAX_SPAN)
    cores = os.cpu_count() or 1
    if args.processes is not None and not 1 <= args.processes <= cores:
        raise DynamicsError(
            f"--processes must be at least 1 and at most this machine's {cores} cores, "
            f"got {args.processes}"
        )
    init_args = _run_init_args(args.init_args)
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


def _run_init_args(texts: Sequence[str]) -> RunInitArgs | None:
    """``--init-args`` of plane and compare: ``RUN.h5=JSON`` (one run's) or ``JSON`` (every
    run's), each once; None when none is given."""
    if not texts:
        return None
    from dynamics.model.rebuild import RunInitArgs

    shared, by_run = None, {}
    for text in texts:
        run, equals, value = text.partition("=")
        if text.lstrip().startswith("{") or not equals:
            run, value = "", text
        if run in by_run or (not run and shared is not None):
            raise DynamicsError(f"--init-args {run + '=' if run else 'JSON'} is given twice")
        args = _json_object(value, f"--init-args {run}=" if run else "--init-args")
        if run:
            by_run[run] = args
        else:
            shared = args
    return RunInitArgs(shared or {}, by_run)


def _json_object(text: str | None, option: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise DynamicsError(f"{option} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise DynamicsError(f"{option} must be a JSON object, got {text}")
    return value


def _report(args: argparse.Namespace) -> int:
    from dynamics.analysis.pages.run_report import write_report

    written = write_report(
        args.runs,
        args.output,
        args.overwrite,
        static_dir=args.static,
        static_format=args.static_format,
    )
    return _print_written(written)


def _compare(args: argparse.Namespace) -> int:
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
    barrier_points = _DEFAULT_BARRIER_POINTS if args.barrier_points is None else args.barrier_points
    if barrier_points == 1 or not 0 <= barrier_points <= _MAX_BARRIER_POINTS:
        raise DynamicsError(
            f"--barrier-points must be 0 or from 2 to {_MAX_BARRIER_POINTS}, got {barrier_points}"
        )
    init_args = _run_init_args(args.init_args)
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
        from dynamics.store import open_run, run_files

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
    return _print_written(written)


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
    _print_table(STATISTICS_HEADER, statistics_rows(comparisons))
    print(STATISTICS_NOTE)
    return 0 if written is None else _print_written(written)


def _print_written(written: Written) -> int:
    print(f"wrote {written.path} ({written.figures} figures, {written.size_bytes / 1e6:.1f} MB)")
    if written.static_files:
        print(f"wrote {len(written.static_files)} figures into {written.static_files[0].parent}")
    if written.static_skipped:
        print(f"dynamics: {written.static_skipped}", file=sys.stderr)
    if written.skipped:
        print(f"dynamics: {written.skipped}", file=sys.stderr)
    return 0


def _overshoot(args: argparse.Namespace) -> int:
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
    _print_table(
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


def _audit(args: argparse.Namespace) -> int:
    import torch

    from dynamics.analysis.measures.bias_audit import recorded_audit
    from dynamics.bias.auditing import audit, audit_batch, token_embedding
    from dynamics.model.probe_batch import probe_batch
    from dynamics.model.rebuild import build_module, rebuild_module
    from dynamics.store import names, open_run

    shape = _shape(args.input_shape)
    init_args = _json_object(args.init_args, "--init-args")
    inputs = [
        option
        for option, value in (
            ("--input-shape", args.input_shape),
            ("--input-json", args.input_json),
            ("--input-file", args.input_file),
        )
        if value is not None
    ]
    if len(inputs) > 1:
        raise DynamicsError(f"{' and '.join(inputs)}: give one example input")
    if args.vocab is not None and (args.vocab < 1 or shape is None):
        raise DynamicsError(
            f"--vocab must be at least 1 and go with --input-shape, got {args.vocab}"
        )
    if args.draws is not None and args.draws < 1:
        raise DynamicsError(f"--draws must be at least 1, got {args.draws}")
    draws = {} if args.draws is None else {"draws": args.draws}
    example, note, result = None, "none (pass --input-shape)", None
    if args.target.endswith(".h5"):
        run = open_run(args.target)
        recorded = recorded_audit(run)
        if recorded is not None and not (inputs or args.model or init_args or draws):
            # The fit's own audit (BiasAudit, on its first batch): nothing to rebuild or guess.
            module = (run.attrs.get(names.ATTR_MODULE) or {}).get("class_path", "?")
            _print_audit(
                args, f"{module.rpartition('.')[2]}, recorded at θ0 by BiasAudit", recorded
            )
            return 0
        model = rebuild_module(run, args.model, init_args, args.trust_recorded_model)
        if not inputs:
            try:  # the batch GradientPlane stored
                batch = probe_batch(run)
            except DynamicsError as error:
                note = f"none ({error}); pass --input-shape"
            else:
                result = audit_batch(model, batch, source="the run's probe batch", **draws)
    elif args.model or args.trust_recorded_model:
        raise DynamicsError("--model and --trust-recorded-model go with a run file")
    else:
        model = build_module(_class_spec(args.target), init_args)
    if args.input_json is not None:
        example, note = _json_input(args.input_json, model)
    elif args.input_file is not None:
        from dynamics.analysis.measures.loss_barrier import load_batch

        loaded = load_batch(args.input_file, what="--input-file")
        example, note = _arguments(loaded.batch), f"{args.input_file} (--input-file)"
    elif shape is not None:
        generator = torch.Generator().manual_seed(0)
        dims = ",".join(map(str, shape))
        embedding = token_embedding(model) if args.vocab is None else None
        if embedding is not None:
            name, table = embedding
            raise DynamicsError(
                f"{type(model).__name__} reads token ids (its first module, {name}, is an "
                f"embedding of {table.num_embeddings} tokens), not N(0, 1) values: pass "
                f"--vocab {table.num_embeddings} with --input-shape, or --input-json"
            )
        if args.vocab is not None:
            example = torch.randint(0, args.vocab, shape, generator=generator)
            note = f"token ids from 0..{args.vocab - 1} of shape {dims} (--vocab, seed 0)"
        else:
            dtype = next(
                (p.dtype for p in model.parameters() if p.is_floating_point()),
                torch.get_default_dtype(),
            )
            example = torch.randn(shape, generator=generator, dtype=dtype)
            note = f"N(0, 1) of shape {dims} (--input-shape, seed 0)"
    if result is None:
        result = audit(model, example, input_note=note, **draws)
    _print_audit(args, type(model).__name__, result)
    return 0


def _json_input(text: str, model: Any) -> tuple[Any, str]:
    """``--input-json``: an object of keyword arguments or an array (the one argument), as
    tensors: integers as int64 (token ids), other numbers in the model's floating dtype."""
    import torch

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise DynamicsError(f"--input-json is not JSON: {error}") from None
    dtype = next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype()
    )

    def tensor(name: str, data: Any) -> torch.Tensor:
        try:
            found = torch.tensor(data)
        except (TypeError, ValueError, RuntimeError) as error:
            raise DynamicsError(
                f"--input-json {name}: not a number or a regular array of numbers ({error})"
            ) from None
        return found.to(dtype) if found.is_floating_point() else found

    if isinstance(value, dict) and value:
        keywords = {key: tensor(key, data) for key, data in value.items()}
        return _arguments(keywords), f"keyword arguments {', '.join(keywords)} (--input-json)"
    if isinstance(value, list):
        return tensor("array", value), "the array of --input-json"
    raise DynamicsError(f"--input-json must be a JSON object of arguments or an array, got {text}")


def _arguments(batch: Any) -> Any:
    """An example input file's content as the forward's arguments: a dict as keywords, a list
    or tuple as positional arguments, anything else as the one argument."""
    from dynamics.params.batch_tree import ForwardArguments

    if isinstance(batch, dict):
        return ForwardArguments((), batch)
    if isinstance(batch, (list, tuple)):
        return ForwardArguments(tuple(batch))
    return batch


def _print_audit(args: argparse.Namespace, what: str, result: AuditResult) -> None:
    if args.json:
        print(json.dumps({"model": args.target, **result.to_dict()}, indent=2))
        return
    print(f"{args.target}  ({what})")
    for line in result.lines():
        print(f"  {line}")
    for title, header, rows in result.tables():
        print(f"\n{title}")
        if rows:
            _print_table(header, rows)
        else:
            print("  none")


def _class_spec(target: str) -> str:
    """``pkg.module:Class`` for ``pkg.module.Class`` (how run files name a class); other forms
    as given."""
    if ":" in target:
        return target
    module, _, name = target.rpartition(".")
    if not module:
        raise DynamicsError(
            f"name the model as pkg.module:Class or path/to/file.py:Class, got {target!r}"
        )
    return f"{module}:{name}"


def _shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(n) for n in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise DynamicsError(f"--input-shape must be positive integers like 8,784, got {text!r}")
    return shape


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print columns aligned two spaces apart; the last one unpadded, for long free text."""
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        print("  ".join([*cells, row[-1]]).rstrip())


#: The parser of every command, public for the docs' CLI reference (docs/hooks/cli_reference.py).
build_parser = _build_parser

if __name__ == "__main__":
    sys.exit(main())
