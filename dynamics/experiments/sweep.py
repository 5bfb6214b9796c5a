"""Sweeps: one experiment config over a grid of overrides, every cell a group of seeds.

Each cell of the grid is the config with the cell's overrides (validated as the YAML's keys
are), trained by the seed runner into ``DIR/cells/<cell>/<variant>/seed<k>.h5``, compared
group against group into ``DIR/cells/<cell>/compare.html``, and measured by the
reproduction's claims (:mod:`dynamics.experiments.paper.claims`, criteria fixed before the
numbers). ``DIR/sweep.json`` holds every cell's status, paired statistics and claims;
``DIR/sweep.html`` shows them over the grid. Every cell is loaded before anything trains; a cell
already complete (its summary lists no failure and stores this cell's config) is read back,
not retrained; a cell that fails is one line and the others go on.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamics.analysis.measures.seed_groups import (
    GroupComparison,
    compare_groups,
    directory_groups,
    load_groups,
)
from dynamics.analysis.output import check_existing_output, write_atomically
from dynamics.analysis.pages.group_comparison import write_group_comparison
from dynamics.errors import DynamicsError, ParameterError
from dynamics.experiments.config import ExperimentConfig
from dynamics.experiments.config_files import load_config
from dynamics.experiments.experiment import Experiment
from dynamics.experiments.launchers import Launcher
from dynamics.experiments.paper.claims import CLAIMS, VERDICT_RULE, ClaimResult, evaluate_claims
from dynamics.experiments.paper.sweep_page import write_sweep_page
from dynamics.experiments.seed_runs import SUMMARY, GroupResult, check_outputs, run_seeds
from dynamics.system import available_cores

__all__ = [
    "CELLS",
    "COMPARISON",
    "PAGE",
    "SCHEMA",
    "SWEEP",
    "Cell",
    "CellResult",
    "SweepResult",
    "grid_cells",
    "run_cells",
]

#: The sweep's summary and page in its output folder.
SWEEP, PAGE = "sweep.json", "sweep.html"
#: The folder of the cells' groups, and each cell's grouped comparison in its folder.
CELLS, COMPARISON = "cells", "compare.html"
#: ``sweep.json``'s ``schema``: a file with it is this sweep's own, replaced by a rerun.
SCHEMA = "dynamics-sweep"
TRAINED, REUSED, FAILED = "trained", "reused", "failed"

_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")
#: The longest cell name, in bytes (file systems allow 255 per folder name).
_LONGEST_NAME = 200
#: Keys :func:`run_cells` sets itself.
_RESERVED = ("seed", "seeds")


@dataclass(frozen=True)
class Cell:
    """One setting of a sweep: dotted config overrides, in grid order, and its folder's name.

    Attributes:
        overrides: ``{"optimizer.lr": 0.01, "optimizer.name": "sgd"}``.
        name: a readable, filesystem-safe folder name; default: the overrides written out,
            ``optimizer.lr=0.01,optimizer.name=sgd``.

    Example::

        Cell({"optimizer.name": "sgd", "optimizer.lr": 0.1})
        Cell({"variants.shifted": 0.01}, name="null-shift")
    """

    overrides: dict[str, Any]
    name: str = ""

    def __post_init__(self) -> None:
        name = self.name or ",".join(f"{k}={_written(v)}" for k, v in self.overrides.items())
        # Any character a file system or a URL treats specially becomes "_".
        object.__setattr__(self, "name", _UNSAFE.sub("_", name) or "defaults")


def _written(value: Any) -> str:
    return (
        json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)
    )


def grid_cells(grid: Mapping[str, Sequence[Any]]) -> list[Cell]:
    """The cells of the Cartesian product of ``grid``'s values, the first key varying slowest.

    Example::

        grid_cells({"optimizer.lr": [1e-3, 1e-2], "optimizer.name": ["adam", "sgd"]})
        # 4 cells: optimizer.lr=0.001,optimizer.name=adam, ..., optimizer.lr=0.01,optimizer.name=sgd

    Raises:
        ParameterError: a key without values.
    """
    for key, values in grid.items():
        if not values:
            raise ParameterError("grid", f"{key} needs at least one value")
    keys = list(grid)
    return [Cell(dict(zip(keys, values))) for values in itertools.product(*grid.values())]


@dataclass(frozen=True)
class CellResult:
    """One cell of a sweep: what became of it and what was measured on it.

    Attributes:
        cell: the cell.
        status: ``"trained"``, ``"reused"`` (complete before, read back) or ``"failed"``.
        error: why it failed, in one line ("" otherwise).
        claims: the claims on its experiment, measured on its groups (none when failed).
        paired: the grouped compare's paired statistics, other group against reference.
        summary: the seed runner's summary of the cell (None when it failed before writing one).
        wall_s: seconds the cell took.
    """

    cell: Cell
    status: str
    error: str = ""
    claims: list[ClaimResult] = field(default_factory=list)
    paired: GroupComparison | None = None
    summary: dict[str, Any] | None = None
    wall_s: float = 0.0

    @property
    def folder(self) -> str:
        """The cell's folder, relative to the sweep's."""
        return f"{CELLS}/{self.cell.name}"

    @property
    def comparison_page(self) -> str | None:
        """The cell's grouped comparison page, relative to the sweep's folder, or None."""
        return None if self.status == FAILED else f"{self.folder}/{COMPARISON}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values, as ``sweep.json`` lists each cell."""
        return {
            "name": self.cell.name,
            "overrides": self.cell.overrides,
            "status": self.status,
            "error": self.error,
            "folder": self.folder,
            "comparison": self.comparison_page,
            "wall_s": self.wall_s,
            "claims": [claim.to_dict() for claim in self.claims],
            "paired_statistics": None
            if self.paired is None
            else {
                "reference": self.paired.reference,
                "other": self.paired.other,
                "statistics": [stat.to_dict() for stat in self.paired.statistics],
            },
            "summary": None if self.summary is None else f"{self.folder}/{SUMMARY}",
            # The seed runner's figures per variant (final losses over seeds), as its summary.
            "figures": None
            if self.summary is None
            else {v: e["figures"] for v, e in self.summary.get("variants", {}).items()},
        }


@dataclass(frozen=True)
class SweepResult:
    """What :func:`run_cells` ran and wrote."""

    cells: list[CellResult]
    data: dict[str, Any]
    json_path: Path
    page_path: Path
    wall_s: float

    @property
    def failed(self) -> list[CellResult]:
        """The cells that failed."""
        return [c for c in self.cells if c.status == FAILED]


def run_cells(
    config: str | Path,
    cells: Sequence[Cell],
    out_dir: str | Path,
    *,
    seeds: Sequence[int],
    jobs: int | None = None,
    launcher: Launcher | None = None,
    overwrite: bool = False,
    progress: bool = True,
    base_overrides: Mapping[str, Any] | None = None,
    command: str = "",
) -> SweepResult:
    """Train every cell over ``seeds`` one cell after another, compare and measure each, and
    write ``out_dir/sweep.json`` and ``out_dir/sweep.html``.

    Each cell's config is ``load_config(config, **base_overrides, **cell.overrides,
    seeds=seeds)``; every cell is loaded and every output checked before anything trains.

    Example::

        cells = grid_cells({"optimizer.lr": [1e-3, 1e-2], "optimizer.name": ["adam", "sgd"]})
        sweep = run_cells("teacher_student", cells, "runs/sweep", seeds=[0, 1, 2],
                          base_overrides={"steps": 600, "eval_every": 50})
        [(c.cell.name, c.status, [r.verdict for r in c.claims]) for c in sweep.cells]

    Args:
        config: a config file or a shipped config's name.
        cells: the cells, in the page's order (:func:`grid_cells`, or any list of them).
        out_dir: the sweep's folder.
        seeds: every cell's seeds (a cell's or the base overrides' ``seed``/``seeds`` are
            refused).
        jobs: runs at a time within a cell (the seed runner's ``jobs``).
        launcher: where each cell's runs train (the seed runner's; None: this machine's
            processes). A cell's runs go out together; the cells one after another.
        overwrite: replace existing outputs of cells that are not complete.
        progress: a line on stderr as each run and each cell ends.
        base_overrides: overrides every cell shares (``steps``, ``eval_every``); none of
            their keys may be a cell's.
        command: the command line, as the summary and page show it.

    Returns:
        Every cell, failed ones included: a cell whose runs fail, or whose seed runner raises,
        is one line in its result and on stderr, and the next cell goes on.

    Raises:
        DynamicsError: before anything trains: ``jobs`` out of range (a ParameterError), no
            cells, two cells of one name (or one too long), a key both in
            ``base_overrides`` and a cell, a cell whose config is refused (the line names the
            cell, the key and the value), or an output that exists without ``overwrite``.
    """
    start = time.monotonic()
    out_dir = Path(out_dir)
    base = dict(base_overrides or {})
    cores = available_cores()
    if launcher is None and jobs is not None and not 1 <= jobs <= cores:
        # The seed runner checks it too, but only per cell: every cell would fail alike.
        raise ParameterError("jobs", f"must be from 1 to this machine's {cores} cores, got {jobs}")
    if not seeds:
        raise ParameterError("seeds", "needs at least one seed")
    loaded = _load_cells(config, cells, base, list(seeds))
    json_path, page_path = out_dir / SWEEP, out_dir / PAGE
    # A sweep's own folder (a rerun): its summary, page and cells' comparisons are replaced.
    ours = _check_own_outputs(json_path, page_path, overwrite)
    reusable = {}
    for cell, experiment, cell_config in loaded:
        folder = out_dir / CELLS / cell.name
        summary = _complete_summary(folder, cell_config)
        if summary is not None:
            reusable[cell.name] = summary
            continue
        _check_group(experiment, cell_config, folder, overwrite)
        check_existing_output(folder / COMPARISON, overwrite or ours)
    results = []
    for index, (cell, experiment, cell_config) in enumerate(loaded, 1):
        began = time.monotonic()
        result = _run_cell(
            cell,
            experiment,
            cell_config,
            out_dir,
            reusable.get(cell.name),
            overwrite,
            jobs,
            progress,
            launcher,
        )
        result = _with_wall(result, time.monotonic() - began)
        results.append(result)
        _report(index, len(loaded), result, progress)
    wall_s = time.monotonic() - start
    data = _sweep_json(config, loaded, results, base, list(seeds), command, wall_s)
    out_dir.mkdir(parents=True, exist_ok=True)  # every cell may have failed before making it
    write_atomically(json_path, json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
    write_sweep_page(data, results, page_path)
    return SweepResult(results, data, json_path, page_path, wall_s)


def _load_cells(
    config: str | Path, cells: Sequence[Cell], base: dict[str, Any], seeds: list[int]
) -> list[tuple[Cell, Experiment, ExperimentConfig]]:
    if not cells:
        raise DynamicsError("a sweep needs at least one cell")
    names = [cell.name for cell in cells]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise DynamicsError(f"two cells are named {twice!r}; cell names must differ")
    loaded = []
    reserved = [k for k in _RESERVED if k in base]
    if reserved:
        raise DynamicsError(f"{reserved[0]} is the sweep's seeds, not a shared setting")
    for cell in cells:
        if len(cell.name.encode()) > _LONGEST_NAME:
            raise DynamicsError(
                f"cell name {cell.name[:40]}... is longer than {_LONGEST_NAME} bytes; name it"
            )
        reserved = [k for k in _RESERVED if k in cell.overrides]
        if reserved:
            raise DynamicsError(f"cell {cell.name}: {reserved[0]} is the sweep's seeds, not a key")
        shared = sorted(set(cell.overrides) & set(base))
        if shared:
            raise DynamicsError(
                f"{shared[0]} is both a cell's key and a setting every cell shares; give it once"
            )
        try:
            experiment, cell_config = load_config(config, **base, **cell.overrides, seeds=seeds)
        except DynamicsError as error:
            raise DynamicsError(f"cell {cell.name}: {error}") from None
        loaded.append((cell, experiment, cell_config))
    return loaded


def _check_own_outputs(json_path: Path, page_path: Path, overwrite: bool) -> bool:
    """The summary and page are replaced without ``overwrite`` only when ``sweep.json`` is a
    sweep's own (a rerun of the sweep in this folder); returns whether it is."""
    ours = False
    if json_path.is_file() and not json_path.is_symlink():
        try:
            ours = json.loads(json_path.read_text(encoding="utf-8")).get("schema") == SCHEMA
        except (OSError, ValueError, AttributeError):
            ours = False
    for path in (json_path, page_path):
        check_existing_output(path, overwrite or ours)
    return ours


def _complete_summary(folder: Path, config: ExperimentConfig) -> dict[str, Any] | None:
    """The cell's summary when its group is complete: no failure, every run file there, and
    the config it stored is ``config`` (as JSON reads it back)."""
    path = folder / SUMMARY
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    wanted = {k: v for k, v in config.to_dict().items() if k != "seed"}
    wanted["seeds"] = list(config.seeds or ())
    wanted = json.loads(json.dumps(wanted, default=str))
    if not isinstance(summary, dict) or summary.get("failed") or summary.get("config") != wanted:
        return None
    try:
        variants = summary["variants"]
        runs = [run for entry in variants.values() for run in entry["runs"].values()]
    except (KeyError, AttributeError, TypeError):  # not a summary the seed runner wrote
        return None
    if len(runs) != len(variants) * len(wanted["seeds"]):
        return None
    if not all((folder / run).is_file() for run in runs):
        return None
    return summary


def _check_group(
    experiment: Experiment, config: ExperimentConfig, folder: Path, overwrite: bool
) -> None:
    """Refuse a cell's outputs as the seed runner would, before any cell trains (its finished
    runs of the same config are kept, to be read back)."""
    check_outputs(experiment, config, folder, overwrite, reuse_finished=True)


def _run_group(
    experiment: Experiment,
    config: ExperimentConfig,
    folder: Path,
    overwrite: bool,
    jobs: int | None,
    progress: bool,
    launcher: Launcher | None,
) -> GroupResult:
    """The seed runner on one cell, reading back the runs an earlier sweep finished."""
    return run_seeds(
        experiment, config, folder, overwrite, jobs, progress, launcher, reuse_finished=True
    )


def _run_cell(
    cell: Cell,
    experiment: Experiment,
    config: ExperimentConfig,
    out_dir: Path,
    summary: dict[str, Any] | None,
    overwrite: bool,
    jobs: int | None,
    progress: bool,
    launcher: Launcher | None,
) -> CellResult:
    folder = out_dir / CELLS / cell.name
    status = REUSED
    if summary is None:
        status = TRAINED
        try:
            # A cell that crashes is one line; the others go on.
            group = _run_group(experiment, config, folder, overwrite, jobs, progress, launcher)
        except Exception as error:
            return CellResult(cell, FAILED, _one_line(error))
        summary = group.summary
        if group.failures:
            first = group.failures[0]
            error = (
                f"{len(group.failures)} runs failed "
                f"(first: {first.variant} seed {first.seed}: {first.error})"
            )
            return CellResult(cell, FAILED, error, summary=summary)
    try:
        groups = load_groups(directory_groups(folder))
        comparisons = compare_groups(groups)
        page = folder / COMPARISON
        if status == TRAINED or not page.is_file():
            write_group_comparison(groups, comparisons, page, True)
        claims = [
            result
            for result in evaluate_claims({experiment.name: (groups[:2], comparisons[0])})
            if result.claim.experiment == experiment.name
        ]
    except DynamicsError as error:
        return CellResult(
            cell, FAILED, f"comparing its groups: {_one_line(error)}", summary=summary
        )
    return CellResult(cell, status, "", claims, comparisons[0], summary)


def _with_wall(result: CellResult, wall_s: float) -> CellResult:
    return dataclasses.replace(result, wall_s=wall_s)


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    return line if isinstance(error, DynamicsError) else f"{type(error).__name__}: {line}"


def _report(index: int, total: int, result: CellResult, progress: bool) -> None:
    if result.status == FAILED:
        print(
            f"dynamics: cell {result.cell.name} failed: {result.error}", file=sys.stderr, flush=True
        )
    elif progress:
        print(
            f"[cell {index}/{total}] {result.cell.name}: {result.status}, {result.wall_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def _grid(cells: Sequence[Cell]) -> dict[str, list[Any]]:
    """Each key of the cells' overrides (in first-seen order) with its values (likewise)."""
    grid: dict[str, list[Any]] = {}
    for cell in cells:
        for key, value in cell.overrides.items():
            values = grid.setdefault(key, [])
            if value not in values:
                values.append(value)
    return grid


def _sweep_json(
    config: str | Path,
    loaded: list[tuple[Cell, Experiment, ExperimentConfig]],
    results: list[CellResult],
    base: dict[str, Any],
    seeds: list[int],
    command: str,
    wall_s: float,
) -> dict[str, Any]:
    experiments = {experiment.name for _, experiment, _ in loaded}
    return {
        "schema": SCHEMA,
        "config": str(config),
        "experiment": ", ".join(sorted(experiments)),
        "command": command,
        "seeds": seeds,
        "base_overrides": base,
        "grid": _grid([cell for cell, _, _ in loaded]),
        "verdict_rule": VERDICT_RULE,
        "claims": [
            {
                "key": c.key,
                "statement": c.statement,
                "figure": c.figure,
                "criterion": c.criterion,
                "weaker": c.weaker,
            }
            for c in CLAIMS
            if c.experiment in experiments
        ],
        "cells": [result.to_dict() for result in results],
        "failed": [result.cell.name for result in results if result.status == FAILED],
        "wall_s": wall_s,
    }
