"""Names of a module's parameters, buffers and submodules as written, without
``torch.compile``'s wrapper.

A compiled submodule (``self.net = torch.compile(net)``) holds its module as ``_orig_mod``, which
adds ``_orig_mod.`` to every name below it but is no layer, so a compiled and an uncompiled run
of one model have one layout (and a run file rebuilds into either).
"""

from __future__ import annotations

import copy

from torch import nn

#: The attribute under which ``torch.compile``'s ``OptimizedModule`` holds the compiled module.
COMPILE_WRAPPER = "_orig_mod"


def unwrapped_name(name: str) -> str:
    """``name`` of a parameter, buffer or submodule without ``torch.compile``'s wrapper."""
    return ".".join(part for part in name.split(".") if part != COMPILE_WRAPPER)


def is_compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper around another (its only child)."""
    return COMPILE_WRAPPER in module._modules


def named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` under their :func:`unwrapped_name`."""
    return [(unwrapped_name(n), p) for n, p in module.named_parameters()]


def named_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module.named_modules()`` under their :func:`unwrapped_name`, ``torch.compile``'s
    wrappers left out (the module they wrap stands under the wrapper's name)."""
    return [
        (unwrapped_name(name), child)
        for name, child in module.named_modules()
        if not is_compile_wrapper(child)
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
