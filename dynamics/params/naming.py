"""Names of a module's parameters, buffers and submodules as written, without the wrappers
``torch.compile``, FSDP and activation checkpointing put around modules.

A compiled submodule (``self.net = torch.compile(net)``) holds its module as ``_orig_mod``, which
adds ``_orig_mod.`` to every name below it but is no layer; FSDP's ``FullyShardedDataParallel``
(``_fsdp_wrapped_module``) and the checkpoint wrapper (``_checkpoint_wrapped_module``) do the
same. Without them a compiled, a sharded and a plain run of one model have one layout (and a run
file rebuilds into any of them). FSDP2's ``fully_shard`` wraps nothing but swaps each sharded
module's class for a subclass of it (``FSDPLinear``); :func:`module_class` sees through that.
"""

from __future__ import annotations

import copy

from torch import nn

#: The attribute under which ``torch.compile``'s ``OptimizedModule`` holds the compiled module.
COMPILE_WRAPPER = "_orig_mod"
#: The attribute under which FSDP1's ``FullyShardedDataParallel`` holds the module it shards.
FSDP_WRAPPER = "_fsdp_wrapped_module"
#: The attributes under which wrappers that are no layer hold the one module they wrap.
WRAPPERS = (COMPILE_WRAPPER, FSDP_WRAPPER, "_checkpoint_wrapped_module")


def unwrapped_name(name: str) -> str:
    """``name`` of a parameter, buffer or submodule without the :data:`WRAPPERS`' parts."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def is_compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper around another (its only child)."""
    return COMPILE_WRAPPER in module._modules


def is_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is one of the :data:`WRAPPERS` around another (no layer itself)."""
    return any(attribute in module._modules for attribute in WRAPPERS)


def module_class(module: nn.Module) -> type:
    """``module``'s class, through the subclass FSDP2's ``fully_shard`` swaps in for it.

    Example::

        module_class(fully_shard(nn.Linear(2, 2)))  # nn.Linear, not FSDPLinear
    """
    cls = type(module)
    for base in cls.__mro__[1:]:
        if base.__name__ == "FSDPModule" and base.__module__.startswith("torch.distributed"):
            return cls.__bases__[-1]  # fully_shard's class is (FSDPModule, the module's class)
    return cls


def named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` under their :func:`unwrapped_name`."""
    return [(unwrapped_name(n), p) for n, p in module.named_parameters()]


def named_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module.named_modules()`` under their :func:`unwrapped_name`, the :data:`WRAPPERS`
    left out (the module they wrap stands under the wrapper's name)."""
    return [
        (unwrapped_name(name), child)
        for name, child in module.named_modules()
        if not is_wrapper(child)
    ]


def named_submodules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`named_modules` but ``module`` itself."""
    return [(name, child) for name, child in named_modules(module) if name]


def compiled_modules(module: nn.Module) -> list[str]:
    """The names of ``module``'s parts ``torch.compile`` compiled: ``""`` for the module itself
    (Lightning unwraps ``trainer.fit(torch.compile(model))`` and compiles its steps in place),
    else each wrapped submodule's :func:`unwrapped_name`."""
    whole = getattr(module, "_compiler_ctx", None) is not None or is_compile_wrapper(module)
    inner = [unwrapped_name(n) for n, m in module.named_modules() if n and is_compile_wrapper(m)]
    return [""] + inner if whole else inner


#: The methods Lightning replaces with compiled ones on the instance when it unwraps
#: ``trainer.fit(torch.compile(model))`` (``pytorch_lightning.utilities.compile.from_compiled``).
_LIGHTNING_COMPILED_METHODS = (
    "forward",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
)


def module_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` that computes with its own parameters.

    Lightning compiles a LightningModule in place: its instance's ``forward`` and steps become
    compiled functions bound to that instance, which a plain ``copy.deepcopy`` keeps, so the
    copy's forward would compute with the original's parameters (another loss, silently). The
    copy's methods are its class's again, uncompiled; compiled submodules copy correctly.
    """
    twin = copy.deepcopy(module)
    for copied in twin.modules():
        if getattr(copied, "_compiler_ctx", None) is not None:
            for method in _LIGHTNING_COMPILED_METHODS:
                copied.__dict__.pop(method, None)
            copied._compiler_ctx = None
    return twin
