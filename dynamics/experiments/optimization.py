"""The optimizer and learning-rate schedule every experiment trains with, from one config section.

:class:`OptimizerConfig` is the ``optimizer:`` section of every experiment's config and
:func:`build_optimization` the one function each experiment's ``configure_optimizers`` calls.
Unset keys (None) take torch's defaults, and a constant schedule without warmup adds no
scheduler, so a config that names only ``name`` and ``lr`` trains exactly as
``torch.optim.<Name>(parameters, lr=lr)`` does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

#: The optimizers a config may name.
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}
#: The learning-rate schedules a config may name.
SCHEDULES = ("constant", "cosine")


@dataclass
class OptimizerConfig:
    """A config's ``optimizer:`` section.

    Attributes:
        name: one of :data:`OPTIMIZERS`.
        lr: the peak learning rate.
        momentum: SGD's momentum (SGD only).
        nesterov: SGD's Nesterov momentum (needs ``momentum`` > 0).
        weight_decay: None: the optimizer's default (0 for Adam and SGD, 0.01 for AdamW).
        betas: Adam's and AdamW's two betas, each in [0, 1); None: torch's (0.9, 0.999).
        warmup_steps: steps of linear warmup from 0 to ``lr``.
        schedule: ``constant``, or ``cosine``: cosine decay after the warmup to
            ``min_lr_ratio`` × ``lr`` at the config's last step.
        min_lr_ratio: where the cosine schedule ends, as a fraction of ``lr``.
    """

    name: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float | None = None
    betas: list[float] | None = None
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0

    def options(self) -> dict[str, Any]:
        """Every key but ``name`` and ``lr`` (a module's ``optimizer_options``)."""
        data = dataclasses.asdict(self)
        del data["name"], data["lr"]
        return data

    def module_kwargs(self) -> dict[str, Any]:
        """The experiments' modules' ``lr``, ``optimizer`` and ``optimizer_options``."""
        return {"lr": self.lr, "optimizer": self.name, "optimizer_options": self.options()}

    def validate(self, steps: int) -> OptimizerConfig:
        """Check the values against each other and the config's ``steps``; returns self.

        Raises:
            ConfigError: one line naming the ``optimizer.`` key.
        """
        # not at the top: the modules import this file, and importing a module must not
        # import the configs (the registry lists experiments without importing them)
        from dynamics.experiments.config import ConfigError

        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}"
            )
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optimizer.momentum must be in [0, 1), got {self.momentum}")
        if self.momentum and self.name != "sgd":
            raise ConfigError(f"optimizer.momentum is SGD's; {self.name} has betas instead")
        if self.nesterov and not self.momentum:
            raise ConfigError("optimizer.nesterov needs SGD with optimizer.momentum > 0")
        decay = self.weight_decay
        if decay is not None and (_not_number(decay) or not math.isfinite(decay) or decay < 0):
            raise ConfigError(f"optimizer.weight_decay must be a number >= 0, got {decay!r}")
        if self.betas is not None:
            if self.name == "sgd":
                raise ConfigError("optimizer.betas are Adam's and AdamW's, not SGD's")
            betas = self.betas
            if not (
                isinstance(betas, list)
                and len(betas) == 2
                and all(not _not_number(b) and 0 <= b < 1 for b in betas)
            ):
                raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {betas!r}")
        if not 0 <= self.warmup_steps < steps:
            raise ConfigError(
                f"optimizer.warmup_steps must be from 0 to steps - 1 ({steps - 1}), "
                f"got {self.warmup_steps}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"optimizer.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        return self


def _not_number(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float))


def lr_factor(config: OptimizerConfig, step: int, steps: int) -> float:
    """The learning rate at ``step`` (of ``steps``) as a fraction of ``config.lr``.

    Example::

        lr_factor(OptimizerConfig(schedule="cosine"), 50, 100)  # 0.5
    """
    warmup = config.warmup_steps
    if step < warmup:
        return step / warmup
    if config.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    low = config.min_lr_ratio
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimization(
    parameters: Iterable[torch.nn.Parameter], config: OptimizerConfig, steps: int
) -> torch.optim.Optimizer | dict[str, Any]:
    """What a LightningModule's ``configure_optimizers`` returns for ``config`` over ``steps``.

    The optimizer alone when the learning rate is constant (no scheduler that could change a
    number), else Lightning's dict with a per-step :class:`~torch.optim.lr_scheduler.LambdaLR`.

    Example::

        def configure_optimizers(self):
            return build_optimization(self.parameters(), self.optimizer_config, self.steps)
    """
    kwargs: dict[str, Any] = {"lr": config.lr}
    if config.name == "sgd" and config.momentum:
        kwargs.update(momentum=config.momentum, nesterov=config.nesterov)
    if config.weight_decay is not None:
        kwargs["weight_decay"] = config.weight_decay
    if config.betas is not None:
        kwargs["betas"] = tuple(config.betas)
    optimizer = OPTIMIZERS[config.name](parameters, **kwargs)
    if config.schedule == "constant" and not config.warmup_steps:
        return optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(config, step, steps)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def module_optimization(module: Any) -> torch.optim.Optimizer | dict[str, Any]:
    """:func:`build_optimization` from a LightningModule's hyperparameters (``optimizer``,
    ``lr``, ``optimizer_options``: :meth:`OptimizerConfig.options`) over its parameters, the
    schedule ending at its trainer's ``max_steps``: every experiment's ``configure_optimizers``.

    Example::

        def configure_optimizers(self):
            return module_optimization(self)
    """
    hparams = module.hparams
    config = OptimizerConfig(
        name=hparams.optimizer, lr=hparams.lr, **(hparams.optimizer_options or {})
    )
    return build_optimization(module.parameters(), config, max(1, module.trainer.max_steps or 1))
