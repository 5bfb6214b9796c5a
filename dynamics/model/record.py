"""What a fit records about its module, so that it can be rebuilt offline: its class path and
init args, and a Hugging Face model's config."""

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
    did not save or whose values JSON cannot hold (modules, dtypes, functions).

    A Hugging Face model (a ``transformers.PreTrainedModel``) is built from its config, which it
    keeps: the record's ``hf_config`` holds the config's class path, its ``to_dict()`` and its
    attention implementation (which ``to_dict()`` leaves out), so ``config`` counts as recorded.

    Example::

        module_record(GPT2LMHeadModel(GPT2Config(n_layer=2)))["hf_config"]["class_path"]
        # 'transformers.models.gpt2.configuration_gpt2.GPT2Config'
    """
    cls = module_class(module)
    hparams = dict(getattr(module, "hparams", {}) or {})
    record: dict[str, Any] = {"class_path": class_path(module)}
    if is_pretrained_model(module):
        config = module.config
        try:
            values = json.loads(json.dumps(config.to_dict()))
        except (TypeError, ValueError):  # a custom config holding objects: config unrecorded
            values = None
        if values is not None:
            record["hf_config"] = {
                "class_path": class_path(config),
                "values": values,
                "attn_implementation": getattr(config, "_attn_implementation", None),
            }
    init_args, unrecorded = {}, []
    for name, value in hparams.items():
        if name.startswith("_"):  # LightningCLI's _class_path/_instantiator, not init args
            continue
        try:
            init_args[name] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            unrecorded.append(name)
    known = set(hparams) | ({"config"} if "hf_config" in record else set())
    unrecorded += [name for name in init_parameters(cls) if name not in known]
    return record | {"init_args": init_args, "unrecorded_init_args": sorted(unrecorded)}


def is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel``, told from its classes' names
    (importing transformers to ask would cost seconds to every fit that does not use it)."""
    return _derives_from(module_class(module), "transformers.modeling_utils", ("PreTrainedModel",))


def is_pretrained_config(cls: type) -> bool:
    """Whether ``cls`` is a ``transformers`` config class (``PreTrainedConfig``, spelled
    ``PretrainedConfig`` before transformers 5)."""
    return _derives_from(
        cls, "transformers.configuration_utils", ("PreTrainedConfig", "PretrainedConfig")
    )


def _derives_from(cls: type, module: str, names: tuple[str, ...]) -> bool:
    return any(c.__module__ == module and c.__qualname__ in names for c in cls.__mro__)


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
