"""Runs every variant of a teacher–student config, one recorded run file per variant."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.errors import DynamicsError
from dynamics.experiments.config import TeacherStudentConfig
from dynamics.experiments.teacher_student import TeacherStudentData, TeacherStudentModule
from dynamics.initial_gradient import initial_gradient
from dynamics.params import ParameterLayout, parameter_vector
from dynamics.plane import Plane, plane_from_gradients
from dynamics.store import open_run

#: Train losses averaged for the summary's "final train loss" (single batches are noisy).
_FINAL_WINDOW = 50


@dataclass(frozen=True)
class VariantResult:
    """What the summary table shows for one student."""

    name: str
    shift: str | float
    path: Path
    final_train_loss: float
    final_heldout_loss: float
    theta0_sha256: str


def run_teacher_student(
    config: TeacherStudentConfig,
    out_dir: str | Path,
    overwrite: bool = False,
    progress: bool = True,
) -> list[VariantResult]:
    """Train each variant of ``config`` and record it into ``out_dir/<variant>.h5``.

    Raises:
        DynamicsError: an output exists and ``overwrite`` is false (checked for every variant
            before any trains, so nothing is half-replaced), or the students' θ0 differ.
    """
    out_dir = Path(out_dir)
    paths = {name: out_dir / f"{name}.h5" for name in config.variants}
    existing = [p for p in paths.values() if p.exists()]
    if existing and not overwrite:
        raise DynamicsError(f"{existing[0]} exists; pass --overwrite to replace it")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DynamicsError(f"cannot create output folder {out_dir}: {error.strerror}") from None
    torch.set_num_threads(config.threads)
    _quiet_lightning()
    students = {name: _student(config, shift) for name, shift in config.variants.items()}
    probe_batch = next(iter(_data(config).train_dataloader()))
    plane = _initial_gradient_plane(list(students.values()), probe_batch)
    results = [
        _train_variant(config, name, students[name], paths[name], plane, probe_batch, progress)
        for name in config.variants
    ]
    if len({r.theta0_sha256 for r in results}) != 1:
        raise DynamicsError("students do not share θ0; the comparison is invalid")
    return results


def _student(config: TeacherStudentConfig, shift: str | float) -> TeacherStudentModule:
    return TeacherStudentModule(
        **vars(config.model),
        shift=shift,
        seed=config.seed,
        lr=config.optimizer.lr,
        optimizer=config.optimizer.name,
    )


def _data(config: TeacherStudentConfig) -> TeacherStudentData:
    return TeacherStudentData(
        **vars(config.model),
        shift=config.data.teacher_shift,
        teacher_seed=config.data.teacher_seed,
        data_seed=config.data.data_seed,
        batch_size=config.data.batch_size,
        heldout_size=config.data.heldout_size,
    )


def _initial_gradient_plane(students: list[TeacherStudentModule], probe_batch: Any) -> Plane | None:
    """The plane of the first two students' initial gradients, before either trains.

    Computed up front so that both run files carry the same plane, and (a, b, r), from step 0.
    """
    if len(students) < 2:
        return None
    layout = ParameterLayout.of(students[0])
    gradients = [initial_gradient(s, probe_batch, layout).double().numpy() for s in students[:2]]
    theta0 = parameter_vector(students[0], layout).double().numpy()
    return plane_from_gradients(theta0, *gradients)


def _train_variant(
    config: TeacherStudentConfig,
    name: str,
    module: TeacherStudentModule,
    path: Path,
    plane: Plane | None,
    probe_batch: Any,
    progress: bool,
) -> VariantResult:
    data = _data(config)
    record = config.record
    every = record.every_n_steps
    probes = [
        TrainingLoss(every),
        HiddenStateNorms(every_n_steps=every),
        ParameterDisplacement(every, snapshot_budget_mb=record.snapshot_budget_mb),
        LoggedMetrics(["val_loss"]),
        GradientPlane(basis=plane, batch=probe_batch, every_n_steps=every),
    ]
    if record.hessian_top_k:
        probes.append(
            HessianSpectrum(
                k=record.hessian_top_k,
                every_n_steps=record.hessian_every_n_steps,
                batch=probe_batch,
            )
        )
    recorder = DynamicsRecorder(
        path,
        probes=probes,
        overwrite=True,  # run_teacher_student refused existing outputs up front
        config={"experiment": "teacher_student", "variant": name, **config.to_dict()},
        run_name=name,
        flush_interval_s=config.record.flush_interval_s,
    )
    trainer = pl.Trainer(
        max_steps=config.steps,
        val_check_interval=config.eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=progress,
        deterministic=True,
    )
    trainer.fit(module, data)
    run = open_run(path)
    train = run.series("loss")["train"]
    heldout = run.series("validation")["val_loss"]
    return VariantResult(
        name=name,
        shift=module.hparams.shift,
        path=path,
        final_train_loss=float(np.nanmean(train[-_FINAL_WINDOW:])),
        final_heldout_loss=float(heldout[-1]) if len(heldout) else float("nan"),
        theta0_sha256=run.attrs["theta0_sha256"],
    )


def _quiet_lightning() -> None:
    # The CLI prints its own summary; Lightning's banners and tips would bury it.
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*IterableDataset.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
