"""Runs every variant of an experiment config for every one of its seeds, through a launcher
(this machine's processes by default, or a cluster's jobs: :mod:`dynamics.experiments.launchers`).

The unit of parallel work is one (variant, seed) run. An experiment's ``recordings()`` may
compute what the variants of one seed share (a plane spanned by their initial gradients) from
all of them built and none trained, so each run — in its own process or in this one alike —
builds every variant of its seed, asks for the recordings, then trains its one variant:
:func:`train_run`. Build and recordings are deterministic functions of the config (the θ0 hash
checks the former), and the global random generators are seeded from the seed before the plan
and again before training, so a run's file does not depend on which process ran it or what ran
there before: ``jobs=1``, ``jobs=N`` and a cluster's jobs record the same series, and seed k of
a group records what ``dynamics run --seed k`` does. Every seed is planned once in this process
before any run starts, so a config that cannot be set up is refused before anything trains.

A rerun with ``reuse_finished`` reads back every run a previous one finished with the same
config instead of training it again (:func:`finished_runs`), so a finished group reruns in the
time it takes to read its files and write its summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dynamics.analysis.measures.run_comparison import loss_crossover
from dynamics.analysis.measures.seed_groups import overtaking_step
from dynamics.analysis.output import check_existing_output, claimed, write_atomically
from dynamics.errors import DynamicsError, ParameterError
from dynamics.experiments import runner
from dynamics.experiments.config import ExperimentConfig
from dynamics.experiments.experiment import Experiment
from dynamics.experiments.launchers import (
    Launcher,
    LocalLauncher,
    PlannedRun,
    RunFailure,
    plan,
    train_run,
)
from dynamics.store import RunFileError, RunLock, open_run
from dynamics.store.schema import decode_attr, encode_attr

#: The summary written beside the runs.
SUMMARY = "summary.json"
#: The figures of each run the summary aggregates over seeds (attributes of VariantResult).
FIGURES = {
    "final_train_loss": "final train loss",
    "final_heldout_loss": "final held-out loss",
    "best_heldout_loss": "best held-out loss",
    "best_heldout_step": "step of the best",
}
#: How the summary states a figure's spread over seeds.
SPREAD = "mean ± sample standard deviation (ddof=1) over seeds, and min–max"


@dataclass(frozen=True)
class GroupResult:
    """What :func:`run_seeds` trained: every finished run, every failure, the summary file."""

    results: dict[tuple[str, int], runner.VariantResult]
    failures: list[RunFailure]
    summary: dict[str, Any]
    summary_path: Path


def run_path(out_dir: Path, variant: str, seed: int) -> Path:
    """Where a group keeps one run: ``out_dir/<variant>/seed<k>.h5``."""
    return out_dir / variant / f"seed{seed}.h5"


def run_seeds(
    experiment: Experiment,
    config: ExperimentConfig,
    out_dir: str | Path,
    overwrite: bool = False,
    jobs: int | None = None,
    progress: bool = True,
    launcher: Launcher | None = None,
    reuse_finished: bool = False,
) -> GroupResult:
    """Train every variant of ``config`` for each of ``config.seeds`` into
    ``out_dir/<variant>/seed<k>.h5`` and write the summary to ``out_dir/summary.json``.

    Example::

        experiment, config = load_config("teacher_student", seeds="0-4", steps=500)
        group = run_seeds(experiment, config, "runs/seeds", jobs=2)
        group.summary["crossover"]  # per shifted variant: the step it overtakes for good
        # the same group as Slurm jobs; a rerun reads the finished runs back
        launcher = SubmititLauncher("runs/seeds/.submitit", parameters={"timeout_min": 30})
        run_seeds(experiment, config, "runs/seeds", launcher=launcher, reuse_finished=True)

    Args:
        jobs: runs at a time, each in its own process (1: one after the other, in this one);
            default: the available cores over ``config.threads``, at most one per run. With
            a ``launcher``, its own ``jobs`` (given here too, it must be the same).
        progress: a line on stderr as each run ends (Lightning's bar only with ``jobs=1``).
        launcher: where the runs train (:mod:`dynamics.experiments.launchers`); default:
            :class:`~dynamics.experiments.launchers.LocalLauncher` with ``jobs``.
        reuse_finished: a run whose file a previous run finished with this run's config is
            read back, not trained (:func:`finished_runs`); a file it did not finish (crashed,
            killed, interrupted) is trained again; one finished with another config is refused
            (replaced with ``overwrite``).

    Returns:
        The group, with any runs that failed: a failure (an exception, or a process or job
        that died) does not stop the others, and every file a run wrote is kept.

    Raises:
        DynamicsError: before anything trains: an output exists and ``overwrite`` (or
            ``reuse_finished``, as above) is false, a variant folder holds a seed file outside
            ``config.seeds`` (a group folder holds one group), ``jobs`` is out of range (a
            ParameterError), an output is being written by another run or the folder by
            another group, or a seed cannot be set up (every seed is planned first).
    """
    if not config.seeds:
        raise DynamicsError("no seeds to run: give seeds (or use run_experiment for one seed)")
    out_dir = Path(out_dir)
    if launcher is None:
        launcher = LocalLauncher(jobs)
    elif jobs is not None and jobs != launcher.jobs:
        raise ParameterError("jobs", f"is the launcher's own ({launcher.jobs}), got {jobs}")
    variants = experiment.variants(config)
    launcher.check(config, len(variants) * len(config.seeds))
    paths = check_outputs(experiment, config, out_dir, overwrite, reuse_finished)
    reused = finished_runs(experiment, config, out_dir, overwrite) if reuse_finished else {}
    runs = [
        PlannedRun(v, s, seed_config(config, s), paths[v, s])
        for s in config.seeds
        for v in variants
        if (v, s) not in reused
    ]
    summary_path = out_dir / SUMMARY
    new_folders = [f for f in (*(out_dir / v for v in variants), out_dir, *out_dir.parents)]
    new_folders = [f for f in dict.fromkeys(new_folders) if not f.exists()]
    locks: dict[tuple[str, int], RunLock] = {}
    group = contextlib.ExitStack()
    try:
        for variant in variants:
            try:
                (out_dir / variant).mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise DynamicsError(
                    f"cannot create output folder {out_dir / variant}: {error.strerror}"
                ) from None
        # Held until the summary is written: runs queued on a cluster hold no lock of their own.
        group.enter_context(claimed([summary_path]))
        for run in runs:
            locks[run.key] = RunLock.acquire(run.path)
        torch.set_num_threads(config.threads)
        runner.quiet_lightning()
        for seed in dict.fromkeys(run.seed for run in runs):
            try:
                plan(experiment, seed_config(config, seed))
            except DynamicsError as error:
                raise DynamicsError(f"seed {seed}: {error}") from None
    except BaseException:
        _release(locks)
        group.close()
        _remove_folders(new_folders)
        raise
    with group:
        try:
            if reused and progress:
                print(
                    f"dynamics: {len(reused)} of {len(paths)} runs finished before with this "
                    "config: read back, not trained again",
                    file=sys.stderr,
                )
            results = {
                (v, s): runner.variant_result(v, variants[v], path)
                for (v, s), path in reused.items()
            }
            trained, failures = launcher.launch(experiment, runs, locks, progress)
            results.update(trained)
            failures += _theta0_failures(results, config.seeds)
            summary = summarize(experiment, config, results, failures, out_dir)
            write_atomically(
                summary_path, json.dumps(summary, indent=2, allow_nan=False, default=str) + "\n"
            )
        finally:
            _release(locks)
    return GroupResult(results, failures, summary, summary_path)


def check_outputs(
    experiment: Experiment,
    config: ExperimentConfig,
    out_dir: Path,
    overwrite: bool,
    reuse_finished: bool = False,
) -> dict[tuple[str, int], Path]:
    """The run files of every (variant, seed) of ``config`` in ``out_dir``, checked as
    :func:`run_seeds` checks them before anything trains.

    Raises:
        DynamicsError: a run file or the summary exists and ``overwrite`` is false, or may not
            be replaced at all (a link, a special file:
            :func:`~dynamics.analysis.output.check_existing_output`), or a variant folder holds
            a seed file outside ``config.seeds``. With ``reuse_finished``, a run file
            :func:`finished_runs` reads back or retrains is no refusal, and the summary is
            rewritten; one it refuses is refused.
    """
    variants = list(experiment.variants(config))
    paths = {(v, s): run_path(out_dir, v, s) for s in config.seeds or () for v in variants}
    reused = finished_runs(experiment, config, out_dir, overwrite) if reuse_finished else {}
    for run, path in paths.items():
        if run not in reused:  # the writer checks a run's content
            check_existing_output(path, overwrite or reuse_finished, kind=None)
    check_existing_output(out_dir / SUMMARY, overwrite or reuse_finished)
    _check_group_folders(out_dir, variants, set(paths.values()))
    return paths


def finished_runs(
    experiment: Experiment, config: ExperimentConfig, out_dir: Path, overwrite: bool = False
) -> dict[tuple[str, int], Path]:
    """The run files in ``out_dir`` of ``config``'s (variant, seed) runs that a previous run
    finished (its status says ``finished``: not crashed, killed or interrupted) with the
    config this run would record: what ``reuse_finished`` reads back instead of training.

    Raises:
        DynamicsError: unless ``overwrite`` (which trains them again): a finished run file
            records another config (the first key that differs is named), or a file there is
            no run file at all.
    """
    reused = {}
    for seed in config.seeds or ():
        one = seed_config(config, seed)
        for variant in experiment.variants(config):
            path = run_path(out_dir, variant, seed)
            if not path.is_file() or path.is_symlink():
                continue  # nothing to reuse; check_existing_output judges a link
            try:
                run = open_run(path)
                state, stored = run.status().state, run.config
            except (RunFileError, OSError) as error:
                if overwrite:
                    continue
                raise DynamicsError(
                    f"{path} cannot be reused or trained again: it is not a run file "
                    f"({str(error).strip().splitlines()[0]}); pass --overwrite to replace it"
                ) from None
            if state != "finished":
                continue  # a partial run: trained again
            planned = decode_attr(encode_attr(runner.recorded_config(experiment, one, variant)))
            # What trained is compared, not how it was asked for: the same steps from the
            # file or from --steps train the same run (each file keeps its own overrides).
            stored, planned = (
                {k: v for k, v in c.items() if k != "overrides"} for c in (stored, planned)
            )
            if stored == planned:
                reused[variant, seed] = path
            elif not overwrite:
                key = _first_difference(stored, planned)
                raise DynamicsError(
                    f"{path} finished with another config ({key}: {_get(stored, key)!r} there, "
                    f"{_get(planned, key)!r} now); pass --overwrite to train it again, or "
                    "choose another output folder"
                )
    return reused


def _first_difference(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> str:
    """The first dotted key (``model.width``) whose value differs between ``a`` and ``b``."""
    for key in sorted({*a, *b}):
        if a.get(key) != b.get(key):
            if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
                return _first_difference(a[key], b[key], f"{prefix}{key}.")
            return f"{prefix}{key}"
    return prefix.rstrip(".")


def _get(data: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        data = data.get(key) if isinstance(data, dict) else None
    return data


def seed_config(config: ExperimentConfig, seed: int) -> ExperimentConfig:
    """The config of one seed's runs: ``config`` with that ``seed`` and no ``seeds``."""
    return dataclasses.replace(config, seed=seed, seeds=None)


def _check_group_folders(out_dir: Path, variants: list[str], ours: set[Path]) -> None:
    """Refuse a variant folder holding another group's seeds: a reader of the folder (the
    grouped compare) would take them for this group's."""
    for variant in variants:
        folder = out_dir / variant
        if folder.is_dir():
            stray = sorted(p for p in folder.glob("seed*.h5") if p not in ours)
            if stray:
                raise DynamicsError(
                    f"{stray[0]} is not one of this command's seeds; a group folder holds one "
                    "group: choose another output folder or remove it"
                )


def _theta0_failures(
    results: dict[tuple[str, int], runner.VariantResult], seeds: list[int]
) -> list[RunFailure]:
    failures = []
    for seed in seeds:
        hashes = {v: r.theta0_sha256 for (v, s), r in results.items() if s == seed}
        if len(set(hashes.values())) > 1:
            failures.extend(
                RunFailure(v, seed, "the variants of this seed do not share θ0") for v in hashes
            )
    return failures


def summarize(
    experiment: Experiment,
    config: ExperimentConfig,
    results: dict[tuple[str, int], runner.VariantResult],
    failures: list[RunFailure],
    out_dir: Path,
) -> dict[str, Any]:
    """The group's summary, as :data:`SUMMARY` holds it: per variant and figure the value of
    every seed and their mean, standard deviation, min and max over the seeds that finished
    (runs that failed are listed under ``failed`` and count in no figure); the figures are
    :data:`FIGURES` and the last value of each other validation metric (``final val_bpc``);
    and per variant besides the baseline, the step of each seed where it overtakes the
    baseline for good (:func:`crossover_steps`)."""
    figures = dict(FIGURES)
    for key in sorted({k for r in results.values() for k in r.final_validation}):
        figures[f"final_{key}"] = f"final {key}"
    variants = {}
    for variant, setting in experiment.variants(config).items():
        mine = {s: results[variant, s] for s in config.seeds if (variant, s) in results}
        variants[variant] = {
            "setting": setting,
            "runs": {str(s): f"{variant}/seed{s}.h5" for s in mine},
            "figures": {
                key: _stats({s: _figure(r, key) for s, r in mine.items()}) for key in figures
            },
            "theta0_sha256": {str(s): r.theta0_sha256 for s, r in mine.items()},
        }
    return {
        "experiment": experiment.name,
        "setting": experiment.setting,
        "seeds": list(config.seeds),
        "spread": SPREAD,
        "figures": figures,
        "config": {**_without_seed(config.to_dict()), "seeds": list(config.seeds)},
        "out": str(out_dir),
        "variants": variants,
        "crossover": crossover_steps(experiment.variants(config), results),
        "failed": [dataclasses.asdict(f) for f in failures],
    }


def _figure(result: runner.VariantResult, key: str) -> float | None:
    if key in FIGURES:
        return getattr(result, key)
    return result.final_validation.get(key.removeprefix("final_"))


def crossover_steps(
    variants: dict[str, object], results: dict[tuple[str, int], runner.VariantResult]
) -> dict[str, Any]:
    """Per variant besides the baseline (the one whose setting is ``none``, else the first),
    the step of each seed after which it stays ahead of the baseline on held-out loss (the
    grouped compare's "overtakes",
    :func:`dynamics.analysis.measures.seed_groups.overtaking_step`), with their statistics; a
    seed without one says why."""
    names = list(variants)
    baseline = next((n for n in names if variants[n] == "none"), names[0])
    crossover = {}
    for variant in names:
        if variant == baseline:
            continue
        steps, why, brackets = {}, {}, []
        for (name, seed), result in sorted(results.items(), key=lambda item: item[0][1]):
            if name != variant or (baseline, seed) not in results:
                continue
            a, b = open_run(results[baseline, seed].path), open_run(result.path)
            step = overtaking_step(a, b, (baseline, variant))
            if isinstance(step, str):
                why[str(seed)] = step
            else:
                steps[seed] = float(step)
                brackets.append(loss_crossover(a, b, (baseline, variant)).bracket)
        crossover[variant] = {
            "baseline": baseline,
            **_stats(steps),
            "not_measured": why,
            # The held-out records every seed's crossing lies between: the interpolated steps
            # are no more precise than the evaluations that bracket them.
            "bracket": (
                [min(lo for lo, _ in brackets), max(hi for _, hi in brackets)] if brackets else None
            ),
        }
    return crossover


def _without_seed(data: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if key != "seed"}


def _stats(values: dict[int, float | None]) -> dict[str, Any]:
    """Per-seed values and, over the finite ones, n, mean, std (ddof=1; None for one), min,
    max. A figure no run could measure is None, never a guess."""
    finite = np.array([v for v in values.values() if v is not None and math.isfinite(v)])
    n = len(finite)
    return {
        "per_seed": {str(s): _json_number(v) for s, v in values.items()},
        "n": n,
        "mean": float(finite.mean()) if n else None,
        "std": float(finite.std(ddof=1)) if n > 1 else None,
        "min": float(finite.min()) if n else None,
        "max": float(finite.max()) if n else None,
    }


def _json_number(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _release(locks: dict[tuple[str, int], RunLock]) -> None:
    for lock in locks.values():
        lock.release()
    locks.clear()


def _remove_folders(folders: list[Path]) -> None:
    """Remove the (then empty) folders a refused call created, deepest first."""
    for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()


__all__ = [
    "FIGURES",
    "SPREAD",
    "SUMMARY",
    "GroupResult",
    "RunFailure",
    "check_outputs",
    "crossover_steps",
    "finished_runs",
    "run_path",
    "run_seeds",
    "seed_config",
    "summarize",
    "train_run",
]
