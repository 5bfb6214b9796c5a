"""What the commands share: exit codes, the parameter-to-flag table, option checks and tables."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from shlex import quote
from typing import TYPE_CHECKING, NoReturn

from dynamics.errors import DynamicsError, ParameterError

if TYPE_CHECKING:
    from dynamics.analysis.pages.page import Written
    from dynamics.experiments.launchers import Launcher
    from dynamics.model.rebuild import RunInitArgs

USAGE_ERROR = 2
#: A shell's status of a command stopped by Ctrl-C (128 + SIGINT).
INTERRUPTED = 130
#: A shell's status of a command whose reader went away (128 + SIGPIPE).
BROKEN_PIPE = 141
#: The largest seed or step count: what a 64-bit signed integer holds.
INT64_MAX = 2**63 - 1

#: The flag that feeds each library parameter, so a library error that names the parameter
#: (:class:`~dynamics.errors.ParameterError`) reaches the user with the flag they typed.
FLAG_OF = {
    # rebuilding a run's model (dynamics.model.rebuild): plane, compare, audit
    "model": "--model",
    "init_args": "--init-args",
    "trust_recorded_model": "--trust-recorded-model",
    # write_plane and its plane
    "plane": "--plane",
    "grid_side": "--grid",
    "margin": "--span",
    "coarse": "--coarse",
    "processes": "--processes",
    # write_comparison's loss barriers
    "barrier_points": "--barrier-points",
    "barrier_batch": "--barrier-batch",
    # compare's groups of runs over seeds
    "group": "--group",
    # the bias audit
    "draws": "--draws",
    # every command that writes
    "overwrite": "--overwrite",
    # run_seeds and reproduce
    "jobs": "--jobs",
    "only": "--only",
    "configs": "--configs",
    # the launcher of the seed runner's runs (add_launcher_arguments)
    "launcher-option": "--launcher-option",
    "parameters": "--launcher-option",
    # load_config's overrides (a bad value in the YAML file is the file's, not a parameter's)
    "steps": "--steps",
    "seed": "--seed",
    "seeds": "--seeds",
    "optimizer.lr": "--lr",
    "set": "--set",
}


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage error is one line (argparse prints the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def error_line(error: DynamicsError) -> str:
    """``error``'s message with each parameter spelled as its flag (:data:`FLAG_OF`): the
    parameter of a :class:`~dynamics.errors.ParameterError`, those a message quotes
    (:meth:`~dynamics.errors.DynamicsError.quoting`), and those of an error that a library
    wrapper quotes in its own message (the wrapper's context)."""
    text, seen = str(error), set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        for quoted in (link, *getattr(link, "quoted", ())):
            if isinstance(quoted, ParameterError) and quoted.parameter in FLAG_OF:
                text = text.replace(str(quoted), quoted.naming(FLAG_OF[quoted.parameter]))
        link = link.__cause__ or link.__context__
    return text


def check_range(option: str, value: float | None, low: float, high: float) -> None:
    """Refuse ``value`` (None: not given) outside ``[low, high]``, or not finite."""
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise DynamicsError(f"{option} must be a number from {low} to {high}, got {value}")


def json_object(text: str | None, option: str) -> dict | None:
    """``option``'s JSON object (None: not given)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise DynamicsError(f"{option} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise DynamicsError(f"{option} must be a JSON object, got {text}")
    return value


def model_arguments(parser: argparse.ArgumentParser) -> None:
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
        help="import the runs' recorded model class and loss function even from outside the "
        "installed packages (e.g. the working directory's modules); importing runs that "
        "module's code",
    )


def run_init_args(texts: Sequence[str]) -> RunInitArgs | None:
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
        args = json_object(value, f"--init-args {run}=" if run else "--init-args")
        if run:
            by_run[run] = args
        else:
            shared = args
    return RunInitArgs(shared or {}, by_run)


#: ``--launcher``'s choices, each with the submitit cluster it names (None: this machine's
#: processes, the seed runner's default).
LAUNCHERS = {"local": None, "slurm": "slurm", "submitit-local": "local"}


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a command's seed runs train: ``--launcher``, ``--launcher-folder`` and
    ``--launcher-option`` (read back by :func:`launcher_from_args`)."""
    parser.add_argument(
        "--launcher",
        choices=list(LAUNCHERS),
        default="local",
        help="where the runs train: this machine's processes (local, the default), Slurm jobs "
        "(slurm), or submitit's local executor (submitit-local); the last two need submitit",
    )
    parser.add_argument(
        "--launcher-folder",
        type=Path,
        metavar="DIR",
        help="submitit's folder for the jobs' submissions and logs (default: OUT/.submitit)",
    )
    parser.add_argument(
        "--launcher-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a submitit parameter, once each: slurm_partition=gpu, timeout_min=60 (default "
        "60), gpus_per_node=1, cpus_per_task=4, mem_gb=16, slurm_account=...",
    )


def launcher_flags(args: argparse.Namespace) -> list[str]:
    """The launcher flags ``args`` gives (beside the default ``--launcher local``), to refuse
    them where nothing is launched."""
    given = {
        "--launcher": args.launcher != "local",
        "--launcher-folder": args.launcher_folder is not None,
        "--launcher-option": bool(args.launcher_option),
    }
    return [flag for flag, present in given.items() if present]


def launcher_from_args(args: argparse.Namespace, out_dir: Path) -> Launcher | None:
    """The launcher ``args`` asks for, holding ``--jobs`` (pass ``args.jobs`` on to the seed
    runner as well); None for ``--launcher local`` (the seed runner's own).

    Raises:
        DynamicsError: a launcher option without a submitit launcher, submitit missing (how to
            install it), a ``KEY=VALUE`` that does not parse or is given twice, or a parameter
            submitit refuses.
    """
    cluster = LAUNCHERS[args.launcher]
    if cluster is None:
        extra = launcher_flags(args)
        if extra:
            raise DynamicsError(f"{extra[0]} goes with --launcher slurm or submitit-local")
        return None
    from dynamics.experiments.launchers import SubmititLauncher, require_submitit
    from dynamics.experiments.overrides import parse_assignment

    require_submitit(f"--launcher {args.launcher}")
    parameters = {}
    for text in args.launcher_option:
        key, value = parse_assignment(text, parameter="launcher-option")
        if key in parameters:
            raise DynamicsError(f"--launcher-option {key} is given twice")
        parameters[key] = value
    folder = args.launcher_folder or Path(out_dir) / ".submitit"
    return SubmititLauncher(folder, cluster, parameters, jobs=getattr(args, "jobs", None))


def html_output_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """The page to write (``-o``) and its figures' static export."""
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


def print_written(written: Written) -> int:
    """What a page's writer wrote, and what it left out (on stderr); exit code 0."""
    print(f"wrote {written.path} ({written.figures} figures, {written.size_bytes / 1e6:.1f} MB)")
    if written.static_files:
        print(f"wrote {len(written.static_files)} figures into {written.static_files[0].parent}")
    if written.static_skipped:
        print(f"dynamics: {written.static_skipped}", file=sys.stderr)
    if written.skipped:
        print(f"dynamics: {written.skipped}", file=sys.stderr)
    for path in written.running:
        print(f"live: {path} is still running; follow it with: dynamics watch {quote(str(path))}")
    return 0


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print columns aligned two spaces apart; the last one unpadded, for long free text."""
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        print("  ".join([*cells, row[-1]]).rstrip())
