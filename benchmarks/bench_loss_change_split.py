"""What one LossChangeSplit record costs, relative to a training step of the same fit.

Workload: the default teacher–student config's unshifted student (width 64, expansion 4, depth
4, batch 128, Adam 1e-3; 133k parameters), with its ReLU and with GELU. Each fit of ``--steps``
steps is trained once without the recorder (the training step's time: the fit's wall time over
its steps, Lightning's own overhead included) and once recording ``LossChangeSplit`` every step
at its defaults (2 Gauss–Legendre nodes per panel, rtol 1e-6, at most 256 gradient evaluations),
whose hooks are timed one by one, in one process. Prints the median record time over the median
training step time, the gradient evaluations per record and the share of rows that met 1e-6.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_loss_change_split.py [--steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, LossChangeSplit
from dynamics.experiments.runner import quiet_lightning
from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule


class TimedSplit(LossChangeSplit):
    """LossChangeSplit whose per-step hooks are timed (both: the copy of θ and the split)."""

    def __init__(self) -> None:
        super().__init__(every_n_steps=1)
        self.seconds: list[float] = []

    def on_step_start(self, trainer, pl_module, batch, step) -> None:
        began = time.perf_counter()
        super().on_step_start(trainer, pl_module, batch, step)
        self._began = time.perf_counter() - began

    def on_step_end(self, trainer, pl_module, batch, outputs, step):
        began = time.perf_counter()
        rows = super().on_step_end(trainer, pl_module, batch, outputs, step)
        self.seconds.append(self._began + time.perf_counter() - began)
        return rows


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._began = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._began)


def fit(activation: str, steps: int, callbacks: list) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(
        TeacherStudentModule(activation=activation), TeacherStudentData(activation=activation)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    quiet_lightning()
    print(
        f"{'activation':<10} {'step ms':>8} {'record ms':>9} {'ratio':>6} {'grads':>6} {'met':>5}"
    )
    for activation in ("relu", "gelu"):
        timer = StepTimer()
        fit(activation, args.steps, [timer])
        probe = TimedSplit()
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "run.h5"
            fit(activation, args.steps, [DynamicsRecorder(path, [probe])])
            rows = open_run(path).series("loss_change")
            evaluations = float(np.median(rows["gradient_evaluations"]))
            met = float(np.mean(rows["converged"]))
        step = statistics.median(timer.seconds[1:])  # the first batch pays for the setup
        record = statistics.median(probe.seconds)
        print(
            f"{activation:<10} {1e3 * step:>8.2f} {1e3 * record:>9.1f} {record / step:>6.1f} "
            f"{evaluations:>6.0f} {met:>5.0%}"
        )


if __name__ == "__main__":
    main()
