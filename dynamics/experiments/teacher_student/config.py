"""The teacher–student experiment's config; every key is optional (defaults below)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamics.bias.activations import ACTIVATIONS
from dynamics.experiments.config import ConfigError, check_positive, check_seeds, check_shifts
from dynamics.experiments.optimization import OptimizerConfig
from dynamics.experiments.shift_experiment import ShiftConfig
from dynamics.experiments.teacher_student.model import parameter_count
from dynamics.system import check_fits


@dataclass
class ModelConfig:
    width: int = 64
    expansion: int = 4
    depth: int = 4
    activation: str = "relu"
    bias: bool = True


@dataclass
class DataConfig:
    batch_size: int = 128
    heldout_size: int = 2048
    teacher_seed: int = 1
    data_seed: int = 2
    teacher_shift: str | float = "none"


@dataclass
class TeacherStudentConfig(ShiftConfig):
    """One comparison: students that differ only in their activation shift (the record section
    and the variants are :class:`~dynamics.experiments.shift_experiment.ShiftConfig`'s).

    Example::

        experiment, config = load_config("teacher_student", steps=200)
        config.model.width, config.variants  # 64, {"unshifted": "none", "shifted": "expected"}
    """

    variant_kind = "student"

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> TeacherStudentConfig:
        super().validate()
        check_positive(
            {
                "model.width": self.model.width,
                "model.depth": self.model.depth,
                "model.expansion": self.model.expansion,
                "data.batch_size": self.data.batch_size,
                "data.heldout_size": self.data.heldout_size,
            }
        )
        check_seeds(
            {"data.teacher_seed": self.data.teacher_seed, "data.data_seed": self.data.data_seed}
        )
        self.optimizer.validate(self.steps)
        if self.model.activation not in ACTIVATIONS:
            raise ConfigError(
                f"model.activation must be one of {', '.join(ACTIVATIONS)}, "
                f"got {self.model.activation!r}"
            )
        check_shifts({"data.teacher_shift": self.data.teacher_shift})
        self._check_size()
        return self

    def _check_size(self) -> None:
        """Refuse what the model's size makes impossible, before anything is built: more
        Hessian eigenvalues than parameters, a snapshot budget that holds fewer than two
        snapshots, or models that cannot fit in memory."""
        params = parameter_count(**vars(self.model))
        record = self.record
        if record.hessian_top_k > params:
            raise ConfigError(
                f"record.hessian_top_k must be at most the model's {params:,} parameters, "
                f"got {record.hessian_top_k}"
            )
        snapshot_mb = 4 * params / 2**20  # float32
        if 0 < record.snapshot_budget_mb < 2 * snapshot_mb:
            raise ConfigError(
                f"record.snapshot_budget_mb={record.snapshot_budget_mb:g} holds fewer than 2 "
                f"snapshots of the model's {params:,} parameters ({snapshot_mb:.3g} MiB each); "
                "raise it, or set 0 for no snapshots"
            )
        # A lower bound: every variant's student and teacher are built before the first
        # trains; training adds a gradient and Adam's two moments, the Hessian probe k vectors.
        floats = params * (2 * len(self.variants) + 3 + record.hessian_top_k)
        floats += 2 * self.model.width * self.data.heldout_size * len(self.variants)
        check_fits(f"this config's model ({params:,} parameters)", 4 * floats)
