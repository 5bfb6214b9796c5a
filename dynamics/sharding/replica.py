"""A plain copy of a sharded module, holding every parameter whole, for extra passes.

Probes that differentiate twice (Hessian-vector products) or evaluate the loss away from θ
cannot run through FSDP's wrapping: its hooks gather and free parameters around each forward,
reduce-scatter gradients after each backward, and double backward through them fails under
FSDP1 and FSDP2 alike. :func:`unsharded_copy` instead gathers the parameters whole onto every
rank (a bucket at a time) and puts them in a copy of the module tree without FSDP: FSDP1's
wrappers are skipped, FSDP2's class swap and hooks are undone, ``torch.compile``'s wrappers are
left out (their compiled code is bound to the original module). The copy computes what the
unsharded module computes, with the rank's own batch; reductions over ranks are the caller's,
exactly as under DDP.

Peak memory: one whole copy of the parameters (and buffers) on every rank while the copy lives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dynamics.params.naming import COMPILE_WRAPPER, FSDP_WRAPPER, module_class, named_parameters
from dynamics.sharding.shards import ParameterShards

#: The hook tables of an ``nn.Module``, each copied without FSDP's hooks.
_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)
#: The tables of flags of forward hooks (hook id: flag), kept for the hooks the copy keeps.
_HOOK_FLAGS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
#: The prefix of the keys under which torch's composable APIs (FSDP2's ``fully_shard``) keep
#: their state in a module's ``__dict__``.
_COMPOSABLE_STATE = "__composable_api_state_key"
#: The methods Lightning replaces with compiled ones on a compiled LightningModule's instance.
_COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


@contextmanager
def unsharded_copy(
    module: nn.Module, shards: ParameterShards, frozen: ParameterShards | None = None
) -> Iterator[nn.Module]:
    """A plain copy of ``module`` with its parameters whole, on every rank (all must enter).

    Its parameters are new tensors (the module's own are not touched; gradients of the copy
    are the copy's), its buffers are copies, its submodules are copies sharing the originals'
    code and non-FSDP hooks. Without sharding ``module`` itself is yielded.

    Args:
        module: the sharded module (a LightningModule under FSDP1 or FSDP2).
        shards: the shards of its trainable parameters.
        frozen: the shards of its frozen parameters, if it has any.

    Example::

        with unsharded_copy(pl_module, shards) as whole:
            loss = loss_rule(whole, batch)  # differentiable twice
    """
    if not shards.sharded and (frozen is None or not frozen.sharded):
        yield module
        return
    whole = dict(shards.full_tensors(module, to="all"))
    if frozen is not None:
        whole |= dict(frozen.full_tensors(module, to="all"))
    by_id = {id(p): whole[name] for name, p in named_parameters(module) if name in whole}
    missing = [name for name, _ in named_parameters(module) if name not in whole]
    if missing:
        raise ValueError(f"no shards were given for parameter {missing[0]!r}")
    yield _plain(module, by_id, {})


def _plain(module: nn.Module, whole: dict[int, torch.Tensor], memo: dict[int, object]) -> nn.Module:
    """``module`` copied without FSDP, with the ``whole`` parameters (by the sharded ones' id)."""
    for wrapper in (FSDP_WRAPPER, COMPILE_WRAPPER):
        if wrapper in module._modules:  # a wrapper is no layer: the copy is of what it wraps
            return _plain(module._modules[wrapper], whole, memo)
    if id(module) in memo:  # a module used twice is one module in the copy too
        return memo[id(module)]  # type: ignore[return-value]
    # A shallow copy of the attributes, of the module's own class (FSDP2's subclass would run
    # fully_shard's __new__, which calls __init__).
    cls = module_class(module)
    twin = cls.__new__(cls)
    twin.__dict__.update(
        (key, value)
        for key, value in module.__dict__.items()
        # FSDP2's state (under torch's composable-API keys) refers to the sharded modules, and
        # a method bound to the original instance (FSDPStrategy's forward redirection leaves
        # ``forward`` so after any redirected call) would compute with the original's shards.
        if not key.startswith(_COMPOSABLE_STATE) and getattr(value, "__self__", None) is not module
    )
    memo[id(module)] = twin
    twin._parameters = {
        name: None if p is None else _parameter(p, whole, memo)
        for name, p in module._parameters.items()
    }
    twin._buffers = {
        name: None if b is None else b.detach().clone() for name, b in module._buffers.items()
    }
    twin._modules = {
        name: None if child is None else _plain(child, whole, memo)
        for name, child in module._modules.items()
    }
    for table in _HOOK_TABLES:
        hooks = getattr(module, table)
        setattr(twin, table, OrderedDict((k, h) for k, h in hooks.items() if not _is_fsdp(h)))
    # The kept hooks' flags, in the copy's own tables: ordered dicts as nn.Module's are, since
    # hook handles keep weak references to them.
    for flags in _HOOK_FLAGS:
        kept = twin._forward_pre_hooks if "pre" in flags else twin._forward_hooks
        setattr(
            twin, flags, OrderedDict((k, v) for k, v in getattr(module, flags).items() if k in kept)
        )
    if getattr(module, "_compiler_ctx", None) is not None:
        for method in _COMPILED_METHODS:  # bound to the original: the copy uses its class's
            twin.__dict__.pop(method, None)
        twin._compiler_ctx = None
    return twin


def _parameter(
    param: nn.Parameter, whole: dict[int, torch.Tensor], memo: dict[int, object]
) -> nn.Parameter:
    # Tied parameters (one tensor under two names) stay one parameter in the copy.
    key = -id(param)
    if key not in memo:
        memo[key] = nn.Parameter(whole[id(param)].detach(), param.requires_grad)
    return memo[key]


def _is_fsdp(hook: object) -> bool:
    """Whether ``hook`` is one of FSDP's (a bound method or function of its modules)."""
    function = getattr(hook, "func", hook)  # functools.partial
    return getattr(function, "__module__", "").startswith("torch.distributed")
