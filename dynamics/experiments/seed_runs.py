"""Runs every variant of an experiment config for every one of its seeds, in parallel processes.

The unit of parallel work is one (variant, seed) run. An experiment's ``recordings()`` may
compute what the variants of one seed share (a plane spanned by their initial gradients) from
all of them built and none trained, so each run — in its own process or in this one alike —
builds every variant of its seed, asks for the recordings, then trains its one variant:
:func:`train_run`. Build and recordings are deterministic functions of the config (the θ0 hash
checks the former), and the global random generators are seeded from the seed before the plan
and again before training, so a run's file does not depend on which process ran it or what ran
there before: ``jobs=1`` and ``jobs=N`` record the same series, and seed k of a group records
what ``dynamics run --seed k`` does. Every seed is planned once in this process before any run
starts, so a config that cannot be set up is refused before anything trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dynamics.analysis.measures.run_comparison import loss_crossover
from dynamics.analysis.measures.seed_groups import overtaking_step
from dynamics.analysis.output import check_existing_output, write_atomically
from dynamics.errors import DynamicsError, ParameterError
from dynamics.experiments import runner
from dynamics.experiments.config import ExperimentConfig
from dynamics.experiments.experiment import Built, Experiment, Recording
from dynamics.store import RunLock, open_run
from dynamics.system import available_cores

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
class RunFailure:
    """A (variant, seed) run that did not finish; ``error`` is one line."""

    variant: str
    seed: int
    error: str
    details: str = ""


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
) -> GroupResult:
    """Train every variant of ``config`` for each of ``config.seeds`` into
    ``out_dir/<variant>/seed<k>.h5`` and write the summary to ``out_dir/summary.json``.

    Example::

        experiment, config = load_config("teacher_student", seeds="0-4", steps=500)
        group = run_seeds(experiment, config, "runs/seeds", jobs=2)
        group.summary["crossover"]  # per shifted variant: the step it overtakes for good

    Args:
        jobs: runs at a time, each in its own process (1: one after the other, in this one);
            default: the available cores over ``config.threads``, at most one per run.
        progress: a line on stderr as each run ends (Lightning's bar only with ``jobs=1``).

    Returns:
        The group, with any runs that failed: a failure (an exception, or a process that died)
        does not stop the others, and every file a run wrote is kept.

    Raises:
        DynamicsError: before anything trains: an output exists and ``overwrite`` is false, a
            variant folder holds a seed file outside ``config.seeds`` (a group folder holds one
            group), ``jobs`` is out of range (a ParameterError), an output is being written by
            another run, or a seed cannot be set up (every seed is planned first).
    """
    if not config.seeds:
        raise DynamicsError("no seeds to run: give seeds (or use run_experiment for one seed)")
    out_dir = Path(out_dir)
    cores = available_cores()
    variants = list(experiment.variants(config))
    runs = [(v, s) for s in config.seeds for v in variants]
    if jobs is None:
        jobs = max(1, min(len(runs), cores // config.threads))
    if not 1 <= jobs <= cores:
        raise ParameterError("jobs", f"must be from 1 to this machine's {cores} cores, got {jobs}")
    paths = check_outputs(experiment, config, out_dir, overwrite)
    summary_path = out_dir / SUMMARY
    new_folders = [f for f in (*(out_dir / v for v in variants), out_dir, *out_dir.parents)]
    new_folders = [f for f in dict.fromkeys(new_folders) if not f.exists()]
    locks: dict[tuple[str, int], RunLock] = {}
    try:
        for variant in variants:
            try:
                (out_dir / variant).mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise DynamicsError(
                    f"cannot create output folder {out_dir / variant}: {error.strerror}"
                ) from None
        for run, path in paths.items():
            locks[run] = RunLock.acquire(path)
        torch.set_num_threads(config.threads)
        runner.quiet_lightning()
        for seed in config.seeds:
            try:
                _plan(experiment, seed_config(config, seed))
            except DynamicsError as error:
                raise DynamicsError(f"seed {seed}: {error}") from None
    except BaseException:
        _release(locks)
        _remove_folders(new_folders)
        raise
    try:
        if jobs == 1:
            results, failures = _serial(experiment, config, runs, paths, locks, progress)
        else:
            results, failures = _parallel(experiment, config, runs, paths, locks, jobs, progress)
    finally:
        _release(locks)
    failures += _theta0_failures(results, config.seeds)
    summary = summarize(experiment, config, results, failures, out_dir)
    write_atomically(
        summary_path, json.dumps(summary, indent=2, allow_nan=False, default=str) + "\n"
    )
    return GroupResult(results, failures, summary, summary_path)


def check_outputs(
    experiment: Experiment, config: ExperimentConfig, out_dir: Path, overwrite: bool
) -> dict[tuple[str, int], Path]:
    """The run files of every (variant, seed) of ``config`` in ``out_dir``, checked as
    :func:`run_seeds` checks them before anything trains.

    Raises:
        DynamicsError: a run file or the summary exists and ``overwrite`` is false, or may not
            be replaced at all (a link, a special file:
            :func:`~dynamics.analysis.output.check_existing_output`), or a variant folder holds
            a seed file outside ``config.seeds``.
    """
    variants = list(experiment.variants(config))
    paths = {(v, s): run_path(out_dir, v, s) for s in config.seeds or () for v in variants}
    for path in paths.values():
        check_existing_output(path, overwrite, kind=None)  # the writer checks a run's content
    check_existing_output(out_dir / SUMMARY, overwrite)
    _check_group_folders(out_dir, variants, set(paths.values()))
    return paths


def seed_config(config: ExperimentConfig, seed: int) -> ExperimentConfig:
    """The config of one seed's runs: ``config`` with that ``seed`` and no ``seeds``."""
    return dataclasses.replace(config, seed=seed, seeds=None)


def train_run(
    experiment: Experiment, config: ExperimentConfig, variant: str, path: Path, progress: bool
) -> runner.VariantResult:
    """One run: build every variant of ``config.seed`` and plan their recordings (they may
    share what is computed from all of them), then train ``variant`` into ``path``."""
    built, recordings = _plan(experiment, config)
    _seed_globals(config.seed)
    setting = experiment.variants(config)[variant]
    return runner._train_variant(
        experiment,
        config,
        variant,
        setting,
        built[variant],
        recordings[variant],
        path,
        progress,
    )


def _plan(
    experiment: Experiment, config: ExperimentConfig
) -> tuple[dict[str, Built], dict[str, Recording]]:
    _seed_globals(config.seed)
    built = {name: experiment.build(config, name) for name in experiment.variants(config)}
    return built, experiment.recordings(config, built)


def _seed_globals(seed: int) -> None:
    """Seed torch's, numpy's and Python's global generators (as Lightning's seed_everything
    does), for experiments that draw from them: dropout, an unseeded sampler."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(np.random.SeedSequence(seed).generate_state(1)[0])


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


def _serial(
    experiment: Experiment,
    config: ExperimentConfig,
    runs: list[tuple[str, int]],
    paths: dict[tuple[str, int], Path],
    locks: dict[tuple[str, int], RunLock],
    progress: bool,
) -> tuple[dict[tuple[str, int], runner.VariantResult], list[RunFailure]]:
    results, failures = {}, []
    for done, (variant, seed) in enumerate(runs, 1):
        locks.pop((variant, seed)).release()  # the recorder locks its path at fit start
        start = time.monotonic()
        try:
            results[variant, seed] = train_run(
                experiment, seed_config(config, seed), variant, paths[variant, seed], progress
            )
        except Exception as error:
            failures.append(_failure(variant, seed, error))
        _report(progress, done, len(runs), variant, seed, start, failures)
    return results, failures


#: The exit status of a run interrupted by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
#: How long interrupted child runs get to close their run files before they are terminated.
_INTERRUPT_GRACE_S = 10.0


def _parallel(
    experiment: Experiment,
    config: ExperimentConfig,
    runs: list[tuple[str, int]],
    paths: dict[tuple[str, int], Path],
    locks: dict[tuple[str, int], RunLock],
    jobs: int,
    progress: bool,
) -> tuple[dict[tuple[str, int], runner.VariantResult], list[RunFailure]]:
    # spawn: a forked child would inherit torch's thread pools and locks mid-state.
    context = multiprocessing.get_context("spawn")
    results, failures = {}, []
    waiting = list(runs)
    active: dict[Connection, tuple[tuple[str, int], Any, float]] = {}
    try:
        while waiting or active:
            while waiting and len(active) < jobs:
                variant, seed = run = waiting.pop(0)
                locks.pop(run).release()
                receive, send = context.Pipe(duplex=False)
                process = context.Process(
                    target=_child,
                    args=(send, experiment, seed_config(config, seed), variant, paths[run]),
                    name=f"dynamics {variant} seed {seed}",
                )
                # A child starts with Ctrl-C ignored (the disposition survives its exec), so an
                # interrupt while it imports is no traceback; _child takes Ctrl-C up itself. A
                # child that got it ends with INTERRUPTED, so one lost here still stops all.
                previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
                try:
                    process.start()
                finally:
                    signal.signal(signal.SIGINT, previous)
                send.close()  # the child holds the other end: its exit ends the pipe
                active[receive] = (run, process, time.monotonic())
            for receive in wait(list(active)):
                (variant, seed), process, start = active.pop(receive)
                try:
                    outcome = receive.recv()
                except EOFError:
                    outcome = None
                receive.close()
                process.join()
                if isinstance(outcome, runner.VariantResult):
                    results[variant, seed] = outcome
                elif isinstance(outcome, RunFailure):
                    failures.append(outcome)
                elif process.exitcode == INTERRUPTED:
                    raise KeyboardInterrupt  # Ctrl-C reached the child: the whole group stops
                else:
                    failures.append(
                        RunFailure(variant, seed, f"its process died ({_exit(process.exitcode)})")
                    )
                done = len(results) + len(failures)
                _report(progress, done, len(runs), variant, seed, start, failures)
    except KeyboardInterrupt:
        _interrupt([process for _, process, _ in active.values()])
        raise
    finally:
        for _, process, _ in active.values():
            process.terminate()
            process.join()
    return results, failures


def _interrupt(processes: list[Any]) -> None:
    """Pass Ctrl-C on to ``processes`` (a terminal sends it to all of them, ``kill -INT`` to
    the parent alone) and give them :data:`_INTERRUPT_GRACE_S` to close their run files."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(process.pid, signal.SIGINT)
    deadline = time.monotonic() + _INTERRUPT_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _child(
    send: Connection, experiment: Experiment, config: ExperimentConfig, variant: str, path: Path
) -> None:
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # started ignoring it
        torch.set_num_threads(config.threads)
        runner.quiet_lightning()
        try:
            outcome: Any = train_run(experiment, config, variant, path, progress=False)
        except Exception as error:
            outcome = _failure(variant, config.seed, error)
        send.send(outcome)
        send.close()
    except KeyboardInterrupt:
        # The parent says "interrupted" once; a traceback from every child would bury it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.exit(INTERRUPTED)


def _failure(variant: str, seed: int, error: Exception) -> RunFailure:
    line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    kind = "" if isinstance(error, DynamicsError) else f"{type(error).__name__}: "
    return RunFailure(variant, seed, f"{kind}{line}", traceback.format_exc())


def _exit(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _report(
    progress: bool,
    done: int,
    total: int,
    variant: str,
    seed: int,
    start: float,
    failures: list[RunFailure],
) -> None:
    failed = failures and (failures[-1].variant, failures[-1].seed) == (variant, seed)
    if failed:
        message = f"dynamics: run {variant} seed {seed} failed: {failures[-1].error}"
        print(message, file=sys.stderr, flush=True)
    elif progress:
        elapsed = time.monotonic() - start
        print(f"[{done}/{total}] {variant} seed {seed}: {elapsed:.1f} s", file=sys.stderr)


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
    "run_path",
    "run_seeds",
    "seed_config",
    "summarize",
    "train_run",
]
