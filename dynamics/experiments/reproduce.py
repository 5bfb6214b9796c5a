"""``dynamics reproduce``: the paper's experiments over seeds, their grouped comparisons, and
one report of the paper's claims with verdicts (:mod:`dynamics.experiments.paper.claims`).

Each experiment of the plan is trained by the seed runner into ``OUT/<experiment>/<variant>/
seed<k>.h5``, compared group against group into ``OUT/<experiment>/compare.html``, and the
claims are measured on those groups into ``OUT/reproduce.html`` and ``OUT/reproduce.json``.
The controlled experiment is also run in each setup of the sensitivity grid
(:mod:`dynamics.experiments.paper.sensitivity`) into ``OUT/sensitivity/<setup>/``, the same
way. Every config is loaded and every output checked before anything trains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamics.analysis.measures.seed_groups import (
    Group,
    GroupComparison,
    compare_groups,
    directory_groups,
    load_groups,
)
from dynamics.analysis.output import check_existing_output, check_output
from dynamics.analysis.pages.group_comparison import write_group_comparison
from dynamics.analysis.pages.page import Written
from dynamics.errors import ParameterError
from dynamics.experiments.config import ConfigError, ExperimentConfig
from dynamics.experiments.config_files import configs_folder, load_config
from dynamics.experiments.experiment import Experiment
from dynamics.experiments.launchers import Launcher
from dynamics.experiments.paper.claims import ClaimResult, evaluate_claims
from dynamics.experiments.paper.reproduction_page import ExperimentRecord, write_reproduction
from dynamics.experiments.paper.sensitivity import (
    EXPERIMENT,
    SENSITIVITY,
    SETUPS,
    SetupResult,
    measure_setup,
)
from dynamics.experiments.seed_runs import RunFailure, check_outputs, run_seeds

__all__ = ["FULL", "QUICK", "REPORT", "Reproduction", "Stage", "reproduce"]

#: The report's file name in the output folder (its JSON: the same stem).
REPORT = "reproduce.html"
#: Each experiment's grouped comparison, in its folder.
COMPARISON = "compare.html"


@dataclass(frozen=True)
class Stage:
    """One experiment of a reproduction: its config file and the overrides applied to it."""

    key: str
    config: str
    seeds: tuple[int, ...]
    overrides: dict[str, Any] = field(default_factory=dict)


#: The full reproduction: every config at its defaults; 5 seeds of the controlled experiment,
#: 3 of the others (about 20 min with --jobs 2 on 2 idle cores, estimated from short timed runs
#: of each config; the whole has not been timed on an idle machine).
FULL = (
    Stage("teacher_student", "teacher_student.yaml", (0, 1, 2, 3, 4)),
    Stage("autoencoder", "autoencoder.yaml", (0, 1, 2)),
    Stage("char_gpt", "char_gpt.yaml", (0, 1, 2)),
    Stage("vit_digits", "vit_digits.yaml", (0, 1, 2)),
)
#: ``--quick``: 3 seeds each, fewer steps (each still past the controlled experiment's
#: crossover near step 190 and the autoencoder's transient near step 50–200), periods shortened
#: so each run still records 12 or more held-out evaluations.
QUICK = (
    Stage(
        "teacher_student",
        "teacher_student.yaml",
        (0, 1, 2),
        {"steps": 600, "eval_every": 50, "record.hessian_every_n_steps": 50},
    ),
    Stage(
        "autoencoder",
        "autoencoder.yaml",
        (0, 1, 2),
        {"steps": 400, "eval_every": 25, "record.hessian_every_n_steps": 100},
    ),
    Stage(
        "char_gpt",
        "char_gpt.yaml",
        (0, 1, 2),
        {"steps": 300, "eval_every": 25, "record.hessian_every_n_steps": 100},
    ),
    Stage(
        "vit_digits",
        "vit_digits.yaml",
        (0, 1, 2),
        {"steps": 400, "eval_every": 25, "record.hessian_every_n_steps": 100},
    ),
)
#: With ``steps`` given, held-out evaluations per run (at least one step apart).
EVALUATIONS = 10
#: The seeds of each sensitivity setup (the default setup's are the controlled experiment's).
SENSITIVITY_SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Reproduction:
    """What :func:`reproduce` wrote and measured."""

    claims: list[ClaimResult]
    experiments: list[ExperimentRecord]
    failures: list[RunFailure]
    written: Written
    json_path: Path
    wall_s: float
    sensitivity: list[SetupResult] = field(default_factory=list)


def reproduce(
    out_dir: str | Path,
    *,
    quick: bool = False,
    jobs: int | None = None,
    overwrite: bool = False,
    configs: str | Path | None = None,
    only: list[str] | None = None,
    steps: int | None = None,
    seeds: list[int] | None = None,
    sets: dict[str, Any] | None = None,
    command: str = "dynamics reproduce",
    progress: bool = True,
    sensitivity: bool = True,
    launcher: Launcher | None = None,
) -> Reproduction:
    """Run the plan (:data:`FULL`, or :data:`QUICK`), compare, and write the report.

    Args:
        out_dir: the output folder.
        quick: the quick plan.
        jobs: runs at a time (the seed runner's ``jobs``).
        overwrite: replace existing outputs.
        configs: the folder of the config files; default: the shipped configs.
        only: run these experiments alone; the others' claims are "not run".
        steps: every experiment trains this many steps, evaluating every ``steps //
            EVALUATIONS`` steps (at least 1).
        seeds: every experiment uses these seeds.
        sets: ``{dotted key: value}`` applied to every experiment's config (``--set``), over
            the plan's own overrides.
        command: the command line, as the report shows it.
        progress: a line on stderr as each run ends.
        sensitivity: also run the controlled experiment over the sensitivity setups (when
            it runs at all).
        launcher: where the runs train (the seed runner's ``launcher``; default: this
            machine's processes).

    Raises:
        DynamicsError: before anything trains: an unknown experiment in ``only``, a config
            that cannot be loaded, or an output that exists without ``overwrite``.
    """
    start = time.monotonic()
    out_dir = Path(out_dir)
    configs = configs_folder() if configs is None else Path(configs)
    plan = QUICK if quick else FULL
    known = [stage.key for stage in plan]
    unknown = sorted(set(only or ()) - set(known))
    if unknown:
        raise ParameterError(
            "only", f"names no experiment {unknown[0]!r} (one of {', '.join(known)})"
        )
    chosen = [stage for stage in plan if only is None or stage.key in only]
    setups = _sensitivity_stages(chosen) if sensitivity else []
    varied = sorted({k for _, stage in setups for k in stage.overrides} & set(sets or {}))
    if varied:
        raise ParameterError(
            "set",
            f"{varied[0]} is what the sensitivity setups vary; add --no-sensitivity to set it",
        )
    loaded = [
        (stage, *_load(stage, Path(configs), steps, seeds, sets or {}))
        for stage in [*chosen, *(stage for _, stage in setups)]
    ]
    report = out_dir / REPORT
    for path in (report, report.with_suffix(".json")):
        check_existing_output(path, overwrite)
    for stage, experiment, config in loaded:
        check_outputs(experiment, config, out_dir / stage.key, overwrite)
        check_existing_output(out_dir / stage.key / COMPARISON, overwrite)
    records, groups, failures = [], {}, []
    reasons = {stage.key: "left out by --only" for stage in plan if stage not in chosen}
    for stage, experiment, config in loaded:
        began = time.monotonic()
        folder = out_dir / stage.key
        group = run_seeds(experiment, config, folder, overwrite, jobs, progress, launcher)
        failures += group.failures
        status, page = "run", None
        if group.failures:
            status = f"failed: {len(group.failures)} runs (first: {group.failures[0].error})"
            reasons[stage.key] = f"its runs {status}"
        else:
            loaded_groups = load_groups(directory_groups(folder))
            comparisons = compare_groups(loaded_groups)
            write_group_comparison(loaded_groups, comparisons, folder / COMPARISON, True)
            groups[stage.key] = (loaded_groups[:2], comparisons[0])
            page = f"{stage.key}/{COMPARISON}"
        wall_s = time.monotonic() - began
        records.append(_record(stage, config, Path(configs), command, status, page, wall_s))
    records += [
        ExperimentRecord(
            s.key,
            str(Path(configs) / s.config),
            command,
            s.seeds,
            None,
            "not run (left out by --only)",
        )
        for s in plan
        if s not in chosen
    ]
    claims = evaluate_claims({k: v for k, v in groups.items() if k in known}, reasons)
    measured, unmeasured = _measure_setups(groups, reasons, setups) if sensitivity else ([], [])
    if not sensitivity:
        unmeasured = ["left out by --no-sensitivity"]
    out_dir.mkdir(parents=True, exist_ok=True)
    out = check_output(report, True)
    wall = time.monotonic() - start
    mode = "quick reproduction (--quick)" if quick else "full reproduction"
    written, json_path = write_reproduction(
        claims,
        records,
        out,
        command=command,
        mode=mode,
        wall_s=wall,
        sensitivity=measured,
        sensitivity_unmeasured=unmeasured,
    )
    return Reproduction(claims, records, failures, written, json_path, wall, measured)


def _sensitivity_stages(chosen: list[Stage]) -> list[tuple[str, Stage]]:
    """``(setup key, stage)`` of each sensitivity setup with overrides (the default setup's
    runs are the controlled experiment's own); none when that experiment does not run."""
    stage = next((s for s in chosen if s.key == EXPERIMENT), None)
    if stage is None:
        return []
    return [
        (
            setup.key,
            Stage(
                f"{SENSITIVITY}/{setup.key}",
                stage.config,
                SENSITIVITY_SEEDS,
                {**stage.overrides, **setup.overrides},
            ),
        )
        for setup in SETUPS
        if setup.overrides
    ]


def _measure_setups(
    groups: dict[str, tuple[list[Group], GroupComparison]],
    reasons: dict[str, str],
    stages: list[tuple[str, Stage]],
) -> tuple[list[SetupResult], list[str]]:
    """Each setup's claims and readings (in :data:`SETUPS` order) where its runs finished,
    and one line per setup that could not be measured."""
    folder_of = {key: stage.key for key, stage in stages}
    results, unmeasured = [], []
    for setup in SETUPS:
        folder = folder_of.get(setup.key, EXPERIMENT)
        if folder in groups:
            results.append(measure_setup(setup, *groups[folder]))
        else:
            why = reasons.get(folder, "the controlled experiment was not run")
            unmeasured.append(f"{setup.label}: {why}")
    return results, unmeasured


def _load(
    stage: Stage,
    configs: Path,
    steps: int | None,
    seeds: list[int] | None,
    sets: dict[str, Any],
) -> tuple[Experiment, ExperimentConfig]:
    overrides = dict(stage.overrides)
    if steps is not None:
        overrides.update(steps=steps, eval_every=max(1, steps // EVALUATIONS))
    overrides.update(sets)
    overrides["seeds"] = list(seeds or stage.seeds)
    try:
        return load_config(configs / stage.config, **overrides)
    except ConfigError as error:
        if not sets:
            raise
        # the same --set reaches every stage: say which stage's experiment refused it
        raise ConfigError(f"--set on {stage.key}: {error}") from None


def _record(
    stage: Stage,
    config: ExperimentConfig,
    configs: Path,
    command: str,
    status: str,
    page: str | None,
    wall_s: float,
) -> ExperimentRecord:
    settings = {"steps": config.steps, "eval_every": config.eval_every}
    # the plan's overrides and every --set, as the runs record them
    settings.update({k: v for k, v in config.overrides.items() if k not in settings})
    described = ", ".join(f"{k}={v}" for k, v in settings.items())
    return ExperimentRecord(
        stage.key,
        f"{configs / stage.config} with {described}",
        command,
        tuple(config.seeds or ()),
        config.steps,
        status,
        page,
        wall_s,
    )
