"""The teacher–student experiment's configuration: defaults in code, overrides from YAML.

Every field has a default, so a YAML file names only what it changes; unknown keys and values of
the wrong type are refused with one line naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from dynamics.activations import SHIFTS
from dynamics.errors import DynamicsError


class ConfigError(DynamicsError):
    """A configuration that cannot be run; the message is one line for the user."""


@dataclass
class ModelConfig:
    width: int = 64
    expansion: int = 4
    depth: int = 4
    activation: str = "relu"
    bias: bool = True


@dataclass
class OptimizerConfig:
    name: str = "adam"
    lr: float = 1e-3


@dataclass
class DataConfig:
    batch_size: int = 128
    heldout_size: int = 2048
    teacher_seed: int = 1
    data_seed: int = 2
    teacher_shift: str | float = "none"


@dataclass
class RecordConfig:
    every_n_steps: int = 1
    snapshot_budget_mb: float = 32.0
    flush_interval_s: float = 5.0
    hessian_top_k: int = 5  # 0 records no Hessian spectrum
    hessian_every_n_steps: int = 100


@dataclass
class TeacherStudentConfig:
    """One comparison: students that differ only in their activation shift.

    Attributes:
        seed: initialization seed shared by every student (so all share θ0).
        steps: optimizer steps per student.
        eval_every: steps between held-out evaluations.
        threads: torch CPU threads (1 is fastest for models this small on a shared machine).
        variants: ``{name: shift}``; each becomes ``<out>/<name>.h5``.
    """

    seed: int = 0
    steps: int = 2000
    eval_every: int = 100
    threads: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    record: RecordConfig = field(default_factory=RecordConfig)
    variants: dict[str, str | float] = field(
        default_factory=lambda: {"unshifted": "none", "shifted": "expected"}
    )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> TeacherStudentConfig:
        positive = {
            "steps": self.steps,
            "eval_every": self.eval_every,
            "threads": self.threads,
            "model.width": self.model.width,
            "model.depth": self.model.depth,
            "model.expansion": self.model.expansion,
            "data.batch_size": self.data.batch_size,
            "data.heldout_size": self.data.heldout_size,
            "record.every_n_steps": self.record.every_n_steps,
            "record.hessian_every_n_steps": self.record.hessian_every_n_steps,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{key} must be >= 1, got {value}")
        if self.record.hessian_top_k < 0:
            raise ConfigError(f"record.hessian_top_k must be >= 0, got {self.record.hessian_top_k}")
        if self.optimizer.lr <= 0:
            raise ConfigError(f"optimizer.lr must be > 0, got {self.optimizer.lr}")
        if not self.variants:
            raise ConfigError("variants must name at least one student")
        shifts = {f"variants.{name}": shift for name, shift in self.variants.items()}
        shifts["data.teacher_shift"] = self.data.teacher_shift
        for key, shift in shifts.items():
            numeric = isinstance(shift, (int, float)) and not isinstance(shift, bool)
            if shift not in SHIFTS and not numeric:
                raise ConfigError(f"{key}: shift must be one of {SHIFTS} or a number: {shift!r}")
        for name in self.variants:
            if not name.replace("_", "").replace("-", "").isalnum():
                raise ConfigError(f"variant name {name!r} must be letters, digits, - or _")
        return self


def load_config(path: str | Path | None = None, **overrides: Any) -> TeacherStudentConfig:
    """Read a YAML config over the defaults, then apply dotted ``overrides`` (``optimizer.lr``).

    Raises:
        ConfigError: missing or unreadable file, unknown key, wrong type or bad value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config {path}: no such file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"config {path}: not valid YAML ({_first_line(error)})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path}: expected a mapping at the top level")
    config = _build(TeacherStudentConfig, data, "")
    for dotted, value in overrides.items():
        if value is not None:
            *parents, leaf = dotted.split(".")
            target = config
            for parent in parents:
                target = getattr(target, parent)
            setattr(target, leaf, value)
    return config.validate()


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!r}; known: {', '.join(known)}")
    values = {}
    for name, value in data.items():
        default = getattr(cls(), name)
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {key!r} must be a mapping")
            values[name] = _build(type(default), value, f"{key}.")
        else:
            values[name] = _checked(key, value, default)
    return cls(**values)


def _checked(key: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
    if isinstance(default, float):
        value = _yaml_float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, dict) and not isinstance(value, dict):
        raise ConfigError(f"config key {key!r} must be a mapping, got {value!r}")
    return value


def _yaml_float(value: Any) -> Any:
    # YAML 1.1 reads 1e-3 (no dot) as a string; accept it as the number it plainly is.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]
