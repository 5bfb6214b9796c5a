"""What a fit records about its module, so that it can be rebuilt offline: its class path and
init args."""

from __future__ import annotations

import inspect
import json
from typing import Any

from torch import nn

from dynamics.params.naming import module_class


def class_path(obj: object) -> str:
    """``module.QualifiedName`` of ``obj``'s class: how run files name a class. A module
    FSDP2's ``fully_shard`` swapped to ``FSDP<Name>`` is named by its own class, so that a
    sharded run records the model an unsharded run does."""
    cls = module_class(obj) if isinstance(obj, nn.Module) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def module_record(module: nn.Module) -> dict[str, Any]:
    """What the run file stores to rebuild ``module``: ``class_path``, the JSON ``init_args``
    it saved as hyperparameters, and ``unrecorded_init_args``, the ``__init__`` arguments it
    did not save or whose values JSON cannot hold (modules, dtypes, functions)."""
    cls = module_class(module)
    hparams = dict(getattr(module, "hparams", {}) or {})
    init_args, unrecorded = {}, []
    for name, value in hparams.items():
        if name.startswith("_"):  # LightningCLI's _class_path/_instantiator, not init args
            continue
        try:
            init_args[name] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            unrecorded.append(name)
    unrecorded += [name for name in init_parameters(cls) if name not in hparams]
    return {
        "class_path": class_path(module),
        "init_args": init_args,
        "unrecorded_init_args": sorted(unrecorded),
    }


def init_parameters(cls: type) -> list[str]:
    """The named arguments of ``cls.__init__`` (not ``*args``/``**kwargs``, which cannot be
    told apart from nothing passed)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in kinds]


def builds_in_configure_model(module: nn.Module) -> bool:
    """Whether the LightningModule's class defines ``configure_model``: layers Lightning builds
    after the callbacks' ``setup``, when a fit (or validation, test, prediction) starts."""
    for cls in type(module).__mro__:
        if cls.__module__.split(".")[0] in ("pytorch_lightning", "lightning"):
            return False
        if "configure_model" in vars(cls):
            return True
    return False
