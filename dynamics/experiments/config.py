"""The config base every experiment's config subclasses, and the checks their values share.

Every field has a default, so a YAML file (read by :mod:`dynamics.experiments.config_files`)
names only what it changes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dynamics.bias.activations import SHIFTS
from dynamics.errors import DynamicsError

#: The experiment of a config without an ``experiment:`` key (configs from before the key).
DEFAULT_EXPERIMENT = "teacher_student"


#: The largest integer a config holds: what torch, numpy and HDF5 hold in 64 bits.
INT64_MAX = 2**63 - 1
#: The most seeds one command trains: each trains every variant, so more is weeks of CPU time
#: (and a typo such as 0-10000000 should not plan ten million runs).
MAX_SEEDS = 1000


#: The Lightning accelerators a config may name, each with whether this machine has one. Runs
#: use one device (the first visible: ``CUDA_VISIBLE_DEVICES`` picks which); "gpu" is CUDA or
#: Apple's MPS, "auto" the best this machine has.
ACCELERATORS: dict[str, Callable[[], bool]] = {
    "cpu": lambda: True,
    "cuda": torch.cuda.is_available,
    "mps": torch.backends.mps.is_available,
    "gpu": lambda: torch.cuda.is_available() or torch.backends.mps.is_available(),
    "auto": lambda: True,
}


class ConfigError(DynamicsError):
    """A configuration that cannot be run; the message is one line for the user."""


@dataclass
class ExperimentConfig:
    """The fields every experiment's config has; each experiment's config subclasses it.

    Attributes:
        seed: initialization seed shared by every variant (so all share θ0).
        seeds: several seeds instead of ``seed`` (a list, or ``"0-4"``, ``"0,2,3"``): every
            variant is trained for each (see :func:`parse_seeds`); a run's own config records
            its one seed as ``seed``.
        steps: optimizer steps per variant.
        eval_every: steps between held-out evaluations.
        threads: torch CPU threads (1 is fastest for models this small on a shared machine).
        accelerator: where each run trains, one of :data:`ACCELERATORS` (one device).
        overrides: ``{dotted key: value}`` that ``load_config`` applied over the file
            (``--set``, ``--steps``, ``--seed``, ``--lr``); recorded, never read from a file.

    Class attributes:
        moved_keys: ``{old key: new dotted key}`` of keys that moved, each refused in a file
            with a line naming where it went.
    """

    moved_keys: ClassVar[dict[str, str]] = {}

    seed: int = 0
    seeds: list[int] | None = None
    steps: int = 2000
    eval_every: int = 100
    threads: int = 1
    accelerator: str = "cpu"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The config as a run file records it: one seed (``seeds`` is the group's, in its
        summary), so a run of a group records what ``--seed k`` alone would."""
        data = dataclasses.asdict(self)
        del data["seeds"]
        return data

    def validate(self) -> ExperimentConfig:
        """Check the values (their types were checked on load); returns the config.

        Raises:
            ConfigError: a value is out of range.
        """
        check_positive(
            {"steps": self.steps, "eval_every": self.eval_every, "threads": self.threads}
        )
        check_seeds({"seed": self.seed})
        if self.seeds is not None:
            self.seeds = parse_seeds(self.seeds, "seeds")
        if self.eval_every > self.steps:
            raise ConfigError(
                f"eval_every ({self.eval_every}) must be at most steps ({self.steps}), "
                "or no held-out loss is ever measured"
            )
        if not isinstance(self.accelerator, str) or self.accelerator not in ACCELERATORS:
            raise ConfigError(
                f"accelerator must be one of {', '.join(ACCELERATORS)}, got {self.accelerator!r}"
            )
        if not ACCELERATORS[self.accelerator]():
            raise ConfigError(f"accelerator {self.accelerator}: this machine has none")
        cores = os.cpu_count() or 1
        if self.threads > cores:
            raise ConfigError(
                f"threads must be at most this machine's {cores} cores, got {self.threads}"
            )
        return self


def check_positive(values: Mapping[str, float]) -> None:
    """Refuse the first of ``{dotted key: value}`` below 1.

    Raises:
        ConfigError: naming the key.
    """
    for key, value in values.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")


def check_seeds(values: Mapping[str, int]) -> None:
    """Refuse the first of ``{dotted key: seed}`` below 0 (the random streams take
    non-negative seeds).

    Raises:
        ConfigError: naming the key.
    """
    for key, value in values.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")


def parse_seeds(value: Any, name: str = "seeds") -> list[int]:
    """Seeds given as a list of integers or as text such as ``"0-4"``, ``"0,2,3"`` or
    ``"0-2,5"`` (ranges include both ends); returned sorted.

    Raises:
        ConfigError: naming ``name``: not integers >= 0, a range that runs backwards, a seed
            given twice, none at all, or more than :data:`MAX_SEEDS`.
    """
    form = f"{name} must be seeds >= 0 like 0-4 or 0,2,3 or [0, 2, 3], got {value!r}"
    seeds: list[int] = []
    if isinstance(value, str):
        for part in value.split(","):
            low, dash, high = part.strip().partition("-")
            if not low.isdigit() or (dash and not high.isdigit()):
                raise ConfigError(form)
            first, last = int(low), int(high) if dash else int(low)
            if last < first:
                raise ConfigError(f"{name}: the range {part.strip()} runs backwards")
            if last - first + len(seeds) >= MAX_SEEDS:  # before the list is made
                raise ConfigError(f"{name}: more than {MAX_SEEDS} seeds")
            seeds.extend(range(first, last + 1))
    elif isinstance(value, list) and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value
    ):
        seeds = list(value)
    else:
        raise ConfigError(form)
    if not seeds:
        raise ConfigError(form)
    if len(seeds) > MAX_SEEDS:
        raise ConfigError(f"{name}: more than {MAX_SEEDS} seeds")
    if max(seeds) > INT64_MAX:
        raise ConfigError(f"{name}: seed {max(seeds)} does not fit in 64 bits")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError(f"{name}: seed {twice[0]} is given twice")
    return sorted(seeds)


def check_shifts(shifts: Mapping[str, Any]) -> None:
    """Refuse a shift that is neither one of :data:`~dynamics.bias.activations.SHIFTS` nor a finite
    number.

    Raises:
        ConfigError: naming the key of the first bad shift.
    """
    for key, shift in shifts.items():
        numeric = isinstance(shift, (int, float)) and not isinstance(shift, bool)
        if shift not in SHIFTS and not (numeric and math.isfinite(shift)):
            raise ConfigError(f"{key}: shift must be one of {SHIFTS} or a finite number: {shift!r}")


def check_shift_variants(variants: Mapping[str, Any], model: str) -> None:
    """Refuse ``{variant: shift}`` that names no ``model``, a bad shift or a bad variant name.

    Raises:
        ConfigError: naming the first bad key.
    """
    if not variants:
        raise ConfigError(f"variants must name at least one {model}")
    check_shifts({f"variants.{name}": shift for name, shift in variants.items()})
    check_variant_names(variants)


def check_variant_names(names: Iterable[str]) -> None:
    """Refuse a variant name that cannot be a file name (each variant is ``<out>/<name>.h5``).

    Raises:
        ConfigError: naming the variant.
    """
    for name in names:
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"variant name {name!r} must be letters, digits, - or _")
