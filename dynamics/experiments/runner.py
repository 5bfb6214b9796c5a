"""Runs every variant of an experiment config, one recorded run file per variant."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch

from dynamics.analysis.output import check_existing_output
from dynamics.callbacks import DynamicsRecorder
from dynamics.errors import DynamicsError
from dynamics.experiments.config import ExperimentConfig
from dynamics.experiments.experiment import Built, Experiment, Recording
from dynamics.experiments.progress import ReturnedLossBar
from dynamics.store import Metric, RunFileError, RunLock, open_run

#: Train losses averaged for the summary's "final train loss" (single batches are noisy).
_FINAL_WINDOW = 50


@dataclass(frozen=True)
class VariantResult:
    """What the summary table shows for one variant.

    Attributes:
        setting: what tells this variant apart (see :attr:`Experiment.setting`).
        final_validation: the last finite value of each validation metric besides the
            held-out loss (``val_bpc``, ``val_acc``); NaN for one that never had one.
    """

    name: str
    setting: object
    path: Path
    final_train_loss: float
    final_heldout_loss: float
    best_heldout_loss: float
    best_heldout_step: int | None
    theta0_sha256: str
    final_validation: dict[str, float] = field(default_factory=dict)


def run_experiment(
    experiment: Experiment,
    config: ExperimentConfig,
    out_dir: str | Path,
    overwrite: bool = False,
    progress: bool = True,
) -> list[VariantResult]:
    """Train each variant of ``config`` and record it into ``out_dir/<variant>.h5``.

    Every output path is checked and locked, every variant built, and the experiment plans
    every recording, before the first trains. When anything fails (an exception, not an
    interrupt), the run files and folders this call created are removed, so the same command
    can be retried; a file that existed before is never removed (with ``overwrite``, a replaced
    one keeps the failed run's record).

    Example::

        experiment, config = load_config("teacher_student", steps=200)
        for result in run_experiment(experiment, config, "runs/demo"):
            print(result.name, result.final_heldout_loss, result.path)

    Raises:
        DynamicsError: an output exists and ``overwrite`` is false, or may not be replaced at
            all (a link, a special file), or another run is writing
            one (checked for every variant before any trains, so nothing is half-replaced), or
            the variants' θ0 differ.
    """
    out_dir = Path(out_dir)
    variants = experiment.variants(config)
    paths = {name: out_dir / f"{name}.h5" for name in variants}
    for path in paths.values():
        check_existing_output(path, overwrite, kind=None)  # the writer checks a run's content
    existing = [p for p in paths.values() if p.exists()]
    new_folders = [f for f in (out_dir, *out_dir.parents) if not f.exists()]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DynamicsError(f"cannot create output folder {out_dir}: {error.strerror}") from None
    new_files = [p for p in paths.values() if p not in existing]
    locks = {}
    try:
        for name, path in paths.items():
            locks[name] = RunLock.acquire(path)
        torch.set_num_threads(config.threads)
        quiet_lightning()
        built = {name: experiment.build(config, name) for name in variants}
        recordings = experiment.recordings(config, built)
        results = []
        for name, setting in variants.items():
            # The recorder locks its path itself at fit start: hand it over just before.
            locks.pop(name).release()
            results.append(
                _train_variant(
                    experiment,
                    config,
                    name,
                    setting,
                    built[name],
                    recordings[name],
                    paths[name],
                    progress,
                )
            )
        if len({r.theta0_sha256 for r in results}) != 1:
            raise DynamicsError("variants do not share θ0; the comparison is invalid")
    except Exception:
        _release(locks)
        _remove_created(new_files, new_folders)
        raise
    finally:
        _release(locks)
    return results


def _release(locks: dict[str, RunLock]) -> None:
    for lock in locks.values():
        lock.release()


def _remove_created(files: list[Path], folders: list[Path]) -> None:
    """Remove the run files and the (then empty) folders a failed call created; a file some
    other live run is writing meanwhile is left alone."""
    for path in files:
        try:
            lock = RunLock.acquire(path)
        except RunFileError:
            continue
        path.unlink(missing_ok=True)
        lock.release()
    for folder in folders:  # deepest first
        with contextlib.suppress(OSError):
            folder.rmdir()


def _train_variant(
    experiment: Experiment,
    config: ExperimentConfig,
    name: str,
    setting: object,
    built: Built,
    recording: Recording,
    path: Path,
    progress: bool,
) -> VariantResult:
    recorder = DynamicsRecorder(
        path,
        probes=recording.probes,
        overwrite=True,  # run_experiment refused existing outputs up front
        config=recorded_config(experiment, config, name),
        run_name=name,
        flush_interval_s=recording.flush_interval_s,
    )
    fit_interruptibly(trainer_for(config, [recorder], progress), built)
    return variant_result(name, setting, path)


def recorded_config(experiment: Experiment, config: ExperimentConfig, name: str) -> dict:
    """The config a run file of variant ``name`` records (its ``run.config``)."""
    return {"experiment": experiment.name, "variant": name, **config.to_dict()}


def variant_result(name: str, setting: object, path: Path) -> VariantResult:
    """What the summary table shows for the run file at ``path``, read from the file (a run
    just trained, or one trained before)."""
    run = open_run(path)
    train, heldout = run.train_loss(), run.heldout_loss()
    best = _best(heldout)
    return VariantResult(
        name=name,
        setting=setting,
        path=path,
        final_train_loss=float(np.nanmean(train.values[-_FINAL_WINDOW:])) if train else math.nan,
        final_heldout_loss=float(heldout.values[-1]) if heldout else math.nan,
        best_heldout_loss=best[0],
        best_heldout_step=best[1],
        theta0_sha256=run.theta0_sha256,
        final_validation={
            key: _last_finite(metric)
            for key, metric in run.validation_metrics().items()
            if heldout is None or key != heldout.name
        },
    )


def fit_interruptibly(trainer: pl.Trainer, built: Built) -> None:
    """Fit ``built`` with ``trainer``; Ctrl-C raises KeyboardInterrupt once the fit has shut
    down (its recorder has closed the run file: crashed, by KeyboardInterrupt).

    Lightning turns an interrupt into ``sys.exit(1)`` after its own shutdown: the command would
    end with status 1 and say nothing, as if it had failed.
    """
    try:
        trainer.fit(built.module, built.data)
    except SystemExit:
        if trainer.interrupted:
            raise KeyboardInterrupt from None
        raise


def trainer_for(
    config: ExperimentConfig, callbacks: list[pl.Callback], progress: bool
) -> pl.Trainer:
    """The Trainer that trains one variant of ``config``, with ``callbacks`` (the recorder).

    No logger, and a bar that shows the returned loss, so that modules need not log it every
    step (:mod:`dynamics.experiments.progress`).
    """
    return pl.Trainer(
        max_steps=config.steps,
        val_check_interval=config.eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[*callbacks, *([ReturnedLossBar(config.steps)] if progress else [])],
        accelerator=config.accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=progress,
        deterministic=True,
    )


def _last_finite(metric: Metric) -> float:
    finite = metric.values[np.isfinite(metric.values)]
    return float(finite[-1]) if len(finite) else math.nan


def _best(heldout: Metric | None) -> tuple[float, int | None]:
    """The lowest finite held-out loss and its step; (NaN, None) when there is none."""
    if heldout is None or not np.isfinite(heldout.values).any():
        return math.nan, None
    i = int(np.nanargmin(np.where(np.isfinite(heldout.values), heldout.values, np.nan)))
    return float(heldout.values[i]), int(heldout.step[i])


def quiet_lightning() -> None:
    # The CLI prints its own summary; Lightning's banners and tips would bury it.
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*IterableDataset.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
