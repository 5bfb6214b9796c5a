"""The controlled experiment's student: a residual MLP regressing a teacher's outputs.

Both students of a comparison are built from the same seed, so they share θ0 bit-for-bit (the
activation shift adds no parameter), see the same batches in the same order and use the same
optimizer; they differ only in the shift.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from dynamics.experiments.optimization import OPTIMIZERS, module_optimization
from dynamics.experiments.progress import logs_training_loss
from dynamics.experiments.teacher_student.streams import seeded_residual_mlp


class TeacherStudentModule(pl.LightningModule):
    """The student: a residual MLP trained by MSE against the teacher's outputs.

    Example::

        recorder = DynamicsRecorder("runs/student.h5", probes=[TrainingLoss()])
        trainer = pl.Trainer(max_steps=200, callbacks=[recorder])
        trainer.fit(TeacherStudentModule(shift="expected"), TeacherStudentData())

    Args:
        width: residual-stream width.
        expansion: hidden width multiple of each block.
        depth: number of residual blocks.
        activation: ``relu``, ``gelu``, ``silu``, ``sigmoid`` or ``tanh``.
        shift: the student's activation shift: ``none``, ``expected``, ``adaptive`` or a number.
        bias: linear layers with biases.
        seed: initialization seed (equal seeds give bit-equal θ0 whatever the shift).
        lr: learning rate.
        optimizer: ``adam``, ``adamw`` or ``sgd``.
        optimizer_options: the other ``optimizer.`` keys
            (:meth:`~dynamics.experiments.optimization.OptimizerConfig.options`); None: defaults.
    """

    def __init__(
        self,
        width: int = 64,
        expansion: int = 4,
        depth: int = 4,
        activation: str = "relu",
        shift: str | float = "none",
        bias: bool = True,
        seed: int = 0,
        lr: float = 1e-3,
        optimizer: str = "adam",
        optimizer_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be adam, adamw or sgd, got {optimizer!r}")
        self.save_hyperparameters()
        self.student = seeded_residual_mlp(
            seed,
            "student",
            width=width,
            expansion=expansion,
            depth=depth,
            activation=activation,
            shift=shift,
            bias=bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)

    def dynamics_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.student(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        loss = self.dynamics_loss(batch)
        # self.log every step is a large share of Lightning's per-step cost at this model size
        # (benchmarks/bench_training_loop.py): only for a reader; the recorder reads the return.
        if logs_training_loss(self.trainer):
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.dynamics_loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        return module_optimization(self)
