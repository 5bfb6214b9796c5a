"""A run's model: what a fit records about its module, loading a stored state into a module (with
its checks), and rebuilding the module offline from the run file."""

from dynamics.model.loading import load_into
from dynamics.model.probe_batch import probe_batch
from dynamics.model.rebuild import (
    MissingInitArgs,
    RunInitArgs,
    build_module,
    rebuild_module,
    recorded_loss_rule,
)

__all__ = [
    "MissingInitArgs",
    "RunInitArgs",
    "build_module",
    "load_into",
    "probe_batch",
    "rebuild_module",
    "recorded_loss_rule",
]
