"""Sharded fits on CPU in two forked gloo processes, for the tests of probes under FSDP.

Lightning's ``FSDPStrategy`` refuses the CPU (it passes ``device_id=root_device.index``, None on
a CPU) and, like ``ModelParallelStrategy``, launches ranks by re-running the script, which under
pytest would re-run pytest. The subclasses here fork instead and give FSDP1 the CPU as its device.
``fully_sharded(Module)`` is a module class whose ``configure_model`` applies FSDP2's
``fully_shard`` to every block of a ``ModuleList`` and then to every top-level child that holds
parameters, as a user of ``ModelParallelStrategy`` would.

The reference for every comparison is DDP on two forked processes (``"ddp_fork"``): the same
ranks read the same batches, so a sharded run's rows must equal it to rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from tests.conftest import make_quiet_trainer

STRATEGIES = ("ddp", "fsdp1", "fsdp2")


class ForkLauncher(_MultiProcessingLauncher):
    """Forks the ranks; the main process's module keeps its weights (rank zero's sharded state
    dict would not load into the unsharded module there)."""

    def __init__(self, strategy) -> None:
        super().__init__(strategy, start_method="fork")

    def _collect_rank_zero_results(self, trainer, results):
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            self._strategy.checkpoint_io.remove_checkpoint(output.weights_path)
            output = output._replace(weights_path=None)
        return output


class CPUFSDPStrategy(FSDPStrategy):
    """FSDP1 on the CPU with gloo, ranks forked."""

    def __init__(self, **kwargs) -> None:
        super().__init__(process_group_backend="gloo", **kwargs)

    def _configure_launcher(self) -> None:
        self._launcher = ForkLauncher(self)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


class ForkModelParallelStrategy(ModelParallelStrategy):
    """FSDP2 through ``ModelParallelStrategy`` (data parallel 2, tensor parallel 1), forked."""

    def __init__(self) -> None:
        super().__init__(data_parallel_size=2, tensor_parallel_size=1)

    def _configure_launcher(self) -> None:
        self._launcher = ForkLauncher(self)


def shard_with_fsdp2(module: nn.Module) -> None:
    """``fully_shard`` every block of each ``ModuleList`` below ``module``, then each of
    ``module``'s direct children that holds parameters."""
    for child in module.modules():
        if isinstance(child, nn.ModuleList):
            for block in child:
                if any(True for _ in block.parameters()):
                    fully_shard(block)
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)


def fully_sharded(module_class: type[pl.LightningModule]) -> type[pl.LightningModule]:
    """``module_class`` with a ``configure_model`` that applies :func:`shard_with_fsdp2`
    (what ``ModelParallelStrategy`` requires of a module)."""

    def configure_model(self) -> None:
        shard_with_fsdp2(self)

    return type(
        f"FullySharded{module_class.__name__}",
        (module_class,),
        {"configure_model": configure_model},
    )


def strategy(name: str):
    """The Trainer ``strategy`` for ``name`` in :data:`STRATEGIES`."""
    if name == "ddp":
        return "ddp_fork"
    if name == "fsdp1":
        return CPUFSDPStrategy()
    if name == "fsdp2":
        return ForkModelParallelStrategy()
    raise ValueError(name)


def module_for(name: str, module_class: type[pl.LightningModule]) -> type[pl.LightningModule]:
    """The module class to fit under strategy ``name`` (FSDP2 shards in ``configure_model``)."""
    return fully_sharded(module_class) if name == "fsdp2" else module_class


def fit(name: str, module: pl.LightningModule, data=None, callbacks=(), **trainer_options) -> None:
    """Fit ``module`` on two forked CPU processes under strategy ``name``."""
    options = dict(max_steps=4, devices=2, strategy=strategy(name), callbacks=list(callbacks))
    options.update(trainer_options)
    make_quiet_trainer(**options).fit(module, data)


class FinalParameters(pl.Callback):
    """Saves the whole trained parameters (by unwrapped name) to ``path`` on rank zero, read
    through torch's own APIs (not the toolkit's), to check that recording changed nothing."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy.model, FullyShardedDataParallel):
            with FullyShardedDataParallel.summon_full_params(
                trainer.strategy.model, writeback=False
            ):
                whole = {n: p.detach().clone() for n, p in _clean(pl_module)}
        else:
            whole = {
                n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in _clean(pl_module)
            }
        if trainer.is_global_zero:
            torch.save(whole, self.path)


def _clean(module: nn.Module):
    for name, p in module.named_parameters():
        yield name.replace("_fsdp_wrapped_module.", ""), p
