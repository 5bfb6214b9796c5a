"""Where the seed runner's (variant, seed) runs train: in this machine's processes, or as jobs
of a cluster scheduler through submitit.

A :class:`Launcher` has one job: train a list of planned runs (:class:`PlannedRun`), say as each
ends whether it finished (a progress line) or failed (one line), and return what finished and
what failed. Every launcher trains a run with the same function, :func:`train_run`, so a run's
file does not depend on where it trained: :class:`LocalLauncher` (this machine: in this process,
or in processes of its own) and :class:`SubmititLauncher` (a job per run: Slurm, or submitit's
local executor) record the same series for the same run.

Locks: the seed runner locks every run file it will write (:class:`~dynamics.store.RunLock`)
while it checks and plans, and a launcher hands each run's lock over just before the run
starts — in another process, or on another host — because the process that writes a file locks
it itself (the recorder, at fit start). The runner also holds its group's lock, on the
summary's path, from its checks to the summary, so no second group starts in the same folder
while runs wait in a queue with no lock on their files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import random
import re
import signal
import sys
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dynamics.errors import DynamicsError, ParameterError
from dynamics.experiments import runner
from dynamics.experiments.config import ExperimentConfig
from dynamics.experiments.experiment import Built, Experiment, Recording
from dynamics.store import RunLock
from dynamics.system import available_cores

#: How to install the optional cluster engine (the ``cluster`` extra).
SUBMITIT_INSTALL = "pip install 'dynamics-for-pytorch[cluster]'"
#: The submitit clusters :class:`SubmititLauncher` drives.
CLUSTERS = ("slurm", "local", "debug")
#: A job's time limit in minutes unless ``timeout_min`` is given (submitit's own defaults, 5
#: minutes on Slurm and 2 locally, would end most training runs).
DEFAULT_TIMEOUT_MIN = 60
#: The exit status of a run interrupted by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
#: How long interrupted runs get to close their run files before they are terminated.
_INTERRUPT_GRACE_S = 10.0

#: What finished, by (variant, seed).
Results = dict[tuple[str, int], runner.VariantResult]


@dataclass(frozen=True)
class RunFailure:
    """A (variant, seed) run that did not finish; ``error`` is one line."""

    variant: str
    seed: int
    error: str
    details: str = ""


@dataclass(frozen=True)
class PlannedRun:
    """One (variant, seed) run of a group: its seed's config and the file it writes."""

    variant: str
    seed: int
    config: ExperimentConfig
    path: Path

    @property
    def key(self) -> tuple[str, int]:
        return self.variant, self.seed


class Launcher(ABC):
    """Trains planned runs somewhere, reporting each as it ends.

    Attributes:
        jobs: runs at a time (None: the launcher's default).
    """

    jobs: int | None = None

    def check(self, config: ExperimentConfig, runs: int) -> None:  # noqa: B027 (optional)
        """Refuse, before anything trains, what this launcher cannot do with ``runs`` runs of
        ``config``.

        Raises:
            DynamicsError: in one line.
        """

    @abstractmethod
    def launch(
        self,
        experiment: Experiment,
        runs: list[PlannedRun],
        locks: dict[tuple[str, int], RunLock],
        progress: bool,
    ) -> tuple[Results, list[RunFailure]]:
        """Train ``runs``; a line on stderr as each ends (a failure's always, a progress line
        with ``progress``).

        Args:
            locks: this process's lock of each run's file: released just before that run
                starts, since its writer locks the file itself.

        Returns:
            What finished, and what failed (a failure does not stop the others).
        """


class LocalLauncher(Launcher):
    """This machine: one run after the other in this process (``jobs=1``), else ``jobs`` at a
    time, each in a process of its own.

    Example::

        group = run_seeds(experiment, config, "runs/seeds", launcher=LocalLauncher(jobs=2))

    Args:
        jobs: runs at a time, from 1 to the available cores; default: the cores over
            ``config.threads``, at most one per run.
    """

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs

    def check(self, config: ExperimentConfig, runs: int) -> None:
        cores = available_cores()
        if self.jobs is not None and not 1 <= self.jobs <= cores:
            raise ParameterError(
                "jobs", f"must be from 1 to this machine's {cores} cores, got {self.jobs}"
            )

    def launch(
        self,
        experiment: Experiment,
        runs: list[PlannedRun],
        locks: dict[tuple[str, int], RunLock],
        progress: bool,
    ) -> tuple[Results, list[RunFailure]]:
        jobs = self.jobs
        if jobs is None:
            threads = runs[0].config.threads if runs else 1
            jobs = max(1, min(len(runs), available_cores() // threads))
        if jobs == 1:
            return _serial(experiment, runs, locks, progress)
        return _parallel(experiment, runs, locks, jobs, progress)


class SubmititLauncher(Launcher):
    """A job per run through submitit: on Slurm (``cluster="slurm"``), on submitit's local
    executor (``"local"``: a process per job on this machine, what the tests use), or one
    after the other in this process (``"debug"``).

    Each job trains its run as a local run does (:func:`train_run`) into the run's path, so the
    file is the one a local run writes; the path must therefore be on a filesystem the jobs
    share with this process. This process submits the jobs, follows their state every
    ``poll_s`` seconds until each has ended (every job has a time limit,
    :data:`DEFAULT_TIMEOUT_MIN` unless ``timeout_min`` is given, so the scheduler ends a stuck
    one), and on Ctrl-C cancels those still queued or running.

    Example::

        launcher = SubmititLauncher(
            "runs/slurm/.submitit",
            parameters={"slurm_partition": "cpu", "timeout_min": 30},
            jobs=4,
        )
        group = run_seeds(experiment, config, "runs/slurm", launcher=launcher)

    Args:
        folder: submitit's folder: each job's submission, pickles and logs
            (``<job id>_0_log.err``, ``.out``).
        cluster: ``"slurm"``, ``"local"`` or ``"debug"``.
        parameters: submitit's parameters (``AutoExecutor.update_parameters``):
            ``timeout_min``, ``gpus_per_node``, ``cpus_per_task``, ``mem_gb``,
            ``slurm_partition``, ``slurm_account``, ...; a parameter of another cluster
            (``slurm_*`` on the local executor) is ignored.
        jobs: runs at a time (on Slurm the job array's parallelism); default: all at once.
        poll_s: seconds between two looks at the jobs' states.

    Raises:
        DynamicsError: submitit is not installed, an unknown ``cluster``, or a parameter
            submitit refuses (a ParameterError naming ``parameters``).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        cluster: str = "slurm",
        parameters: dict[str, Any] | None = None,
        jobs: int | None = None,
        poll_s: float = 5.0,
    ) -> None:
        submitit = require_submitit("SubmititLauncher")
        if cluster not in CLUSTERS:
            raise ParameterError(
                "cluster", f"must be one of {', '.join(CLUSTERS)}, got {cluster!r}"
            )
        if jobs is not None and jobs < 1:
            raise ParameterError("jobs", f"must be at least 1, got {jobs}")
        if not poll_s > 0:
            raise ParameterError("poll_s", f"must be > 0, got {poll_s}")
        self.folder, self.cluster, self.jobs, self.poll_s = Path(folder), cluster, jobs, poll_s
        self.parameters = {"timeout_min": DEFAULT_TIMEOUT_MIN, **(parameters or {})}
        try:
            self._executor = submitit.AutoExecutor(folder=self.folder, cluster=cluster)
        except RuntimeError as error:  # e.g. Slurm asked for where there is no srun
            raise DynamicsError(f"the {cluster} launcher cannot start here: {error}") from None
        settings = dict(self.parameters)
        if cluster == "slurm" and jobs is not None:
            settings["slurm_array_parallelism"] = jobs  # the scheduler keeps the array to it
        try:
            self._executor.update_parameters(**settings)
        except (AssertionError, NameError, TypeError, ValueError) as error:
            # submitit says what is wrong on its first line, then lists every parameter
            first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise ParameterError("parameters", f"refused by submitit: {first}") from None

    def launch(
        self,
        experiment: Experiment,
        runs: list[PlannedRun],
        locks: dict[tuple[str, int], RunLock],
        progress: bool,
    ) -> tuple[Results, list[RunFailure]]:
        # Slurm keeps its array to `jobs` itself; elsewhere each job is a process started at
        # submission, so they are submitted `jobs` at a time.
        window = None if self.cluster == "slurm" else self.jobs
        results: Results = {}
        failures: list[RunFailure] = []
        waiting = list(runs)
        active: dict[tuple[str, int], tuple[PlannedRun, Any, float]] = {}
        try:
            while waiting or active:
                free = len(waiting) if window is None else window - len(active)
                if waiting and free > 0:
                    batch, waiting = waiting[:free], waiting[free:]
                    for run in batch:
                        locks.pop(run.key).release()
                    started = time.monotonic()
                    for run, job in zip(batch, self._submit(experiment, batch)):
                        if self.cluster == "local":
                            # a local job writes its result before its process ends: no
                            # waiting for a slow shared filesystem (15 s) on a killed one
                            job._results_timeout_s = 0
                        active[run.key] = (run, job, started)
                ended = [key for key, (_, job, _) in active.items() if job.done()]
                for key in ended:
                    run, job, started = active.pop(key)
                    outcome = self._outcome(run, job)
                    if isinstance(outcome, RunFailure):
                        failures.append(outcome)
                    else:
                        results[key] = outcome
                    done = len(results) + len(failures)
                    _report(progress, done, len(runs), *key, started, failures)
                if active and not ended:
                    time.sleep(self.poll_s)
        except KeyboardInterrupt:
            _cancel([job for _, job, _ in active.values()])
            raise
        return results, failures

    def _submit(self, experiment: Experiment, batch: list[PlannedRun]) -> list[Any]:
        try:
            return self._executor.map_array(
                _job,
                [experiment] * len(batch),
                [run.config for run in batch],
                [run.variant for run in batch],
                # the job's working folder may not be this one
                [run.path.absolute() for run in batch],
            )
        except Exception as error:  # sbatch missing or refusing, an unwritable folder
            line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise DynamicsError(f"cannot submit the runs to {self.cluster}: {line}") from None

    def _outcome(self, run: PlannedRun, job: Any) -> runner.VariantResult | RunFailure:
        log = job.paths.stderr
        try:
            outcome = job.result()
        except Exception as error:  # the job ended outside train_run: killed, timed out, ...
            return RunFailure(
                run.variant,
                run.seed,
                f"its job {job.job_id} {_job_end(error)} (state {job.state}; log: {log})",
                str(error),
            )
        if isinstance(outcome, RunFailure):
            return dataclasses.replace(outcome, error=f"{outcome.error} (log: {log})")
        return dataclasses.replace(outcome, path=run.path)  # as the caller spelled it


def require_submitit(what: str) -> Any:
    """The ``submitit`` module, or a one-line refusal naming ``what`` needs it.

    Raises:
        DynamicsError: submitit is not installed.
    """
    try:
        import submitit
    except ImportError:
        raise DynamicsError(f"{what} needs submitit: {SUBMITIT_INSTALL}") from None
    return submitit


def train_run(
    experiment: Experiment, config: ExperimentConfig, variant: str, path: Path, progress: bool
) -> runner.VariantResult:
    """One run: build every variant of ``config.seed`` and plan their recordings (they may
    share what is computed from all of them), then train ``variant`` into ``path``."""
    built, recordings = plan(experiment, config)
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


def plan(
    experiment: Experiment, config: ExperimentConfig
) -> tuple[dict[str, Built], dict[str, Recording]]:
    """Every variant of ``config.seed`` built, and their recordings planned."""
    _seed_globals(config.seed)
    built = {name: experiment.build(config, name) for name in experiment.variants(config)}
    return built, experiment.recordings(config, built)


def _seed_globals(seed: int) -> None:
    """Seed torch's, numpy's and Python's global generators (as Lightning's seed_everything
    does), for experiments that draw from them: dropout, an unseeded sampler."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(np.random.SeedSequence(seed).generate_state(1)[0])


def _train_quietly(
    experiment: Experiment, config: ExperimentConfig, variant: str, path: Path
) -> runner.VariantResult | RunFailure:
    """One run in a process of its own (a child, a job): its result, or its failure."""
    torch.set_num_threads(config.threads)
    runner.quiet_lightning()
    try:
        return train_run(experiment, config, variant, path, progress=False)
    except Exception as error:
        return _failure(variant, config.seed, error)


def _job(
    experiment: Experiment, config: ExperimentConfig, variant: str, path: Path
) -> runner.VariantResult | RunFailure:
    outcome = _train_quietly(experiment, config, variant, path)
    if isinstance(outcome, RunFailure):
        print(outcome.details, file=sys.stderr, flush=True)  # the traceback, in the job's log
    return outcome


def _job_end(error: Exception) -> str:
    """How a job that returned nothing ended, in a few words: the last line of the traceback
    submitit kept (an import or unpickling error, an interrupt), else no result (a killed or
    timed-out job)."""
    text = str(error)
    parts = re.split(r"\n-{10,}\n", text)
    if type(error).__name__ == "FailedJobError" and len(parts) >= 2:
        lines = [line.strip() for line in parts[1].splitlines() if line.strip()]
        if lines:
            return f"failed: {lines[-1]}"
    return "ended without a result"


def _cancel(jobs: list[Any]) -> None:
    """Cancel ``jobs`` and give them :data:`_INTERRUPT_GRACE_S` to close their run files."""
    for job in jobs:
        with contextlib.suppress(Exception):  # an ended job, a scheduler that is gone
            job.cancel(check=False)
    deadline = time.monotonic() + _INTERRUPT_GRACE_S
    with contextlib.suppress(Exception):
        while time.monotonic() < deadline and not all(job.done() for job in jobs):
            time.sleep(0.2)


def _serial(
    experiment: Experiment,
    runs: list[PlannedRun],
    locks: dict[tuple[str, int], RunLock],
    progress: bool,
) -> tuple[Results, list[RunFailure]]:
    results, failures = {}, []
    for done, run in enumerate(runs, 1):
        locks.pop(run.key).release()  # the recorder locks its path at fit start
        start = time.monotonic()
        try:
            results[run.key] = train_run(experiment, run.config, run.variant, run.path, progress)
        except Exception as error:
            failures.append(_failure(run.variant, run.seed, error))
        _report(progress, done, len(runs), run.variant, run.seed, start, failures)
    return results, failures


def _parallel(
    experiment: Experiment,
    runs: list[PlannedRun],
    locks: dict[tuple[str, int], RunLock],
    jobs: int,
    progress: bool,
) -> tuple[Results, list[RunFailure]]:
    # spawn: a forked child would inherit torch's thread pools and locks mid-state.
    context = multiprocessing.get_context("spawn")
    results, failures = {}, []
    waiting = list(runs)
    active: dict[Connection, tuple[tuple[str, int], Any, float]] = {}
    # Set before Ctrl-C is passed on: a child still importing ignores the signal, and reads
    # this once it takes Ctrl-C up (set, then signalled; handler, then read: none is missed).
    interrupted = context.Event()
    try:
        while waiting or active:
            while waiting and len(active) < jobs:
                run = waiting.pop(0)
                locks.pop(run.key).release()
                receive, send = context.Pipe(duplex=False)
                process = context.Process(
                    target=_child,
                    args=(send, interrupted, experiment, run.config, run.variant, run.path),
                    name=f"dynamics {run.variant} seed {run.seed}",
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
                active[receive] = (run.key, process, time.monotonic())
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
        interrupted.set()
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
    send: Connection,
    interrupted: Any,
    experiment: Experiment,
    config: ExperimentConfig,
    variant: str,
    path: Path,
) -> None:
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # started ignoring it
        if interrupted.is_set():  # Ctrl-C came while this child was starting
            raise KeyboardInterrupt
        send.send(_train_quietly(experiment, config, variant, path))
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


__all__ = [
    "CLUSTERS",
    "DEFAULT_TIMEOUT_MIN",
    "INTERRUPTED",
    "SUBMITIT_INSTALL",
    "Launcher",
    "LocalLauncher",
    "PlannedRun",
    "Results",
    "RunFailure",
    "SubmititLauncher",
    "plan",
    "require_submitit",
    "train_run",
]
