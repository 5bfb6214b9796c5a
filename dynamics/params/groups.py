"""Which group each trainable parameter belongs to: by kind, by layer, or by name patterns.

Kinds (the default): a parameter of a normalization module — one whose class name contains
``Norm`` (``LayerNorm``, ``RMSNorm``, ``BatchNorm2d``, ``GroupNorm``, ``InstanceNorm1d`` and a
user's own ``LayerNorm``) — is ``normalization``, its weight and its bias alike, since both act
on normalized features; otherwise a 1-D parameter named ``bias``, ``bias_*`` (recurrent layers'
``bias_ih_l0``) or ``*_bias`` (attention's ``in_proj_bias``) is a ``bias``; everything else —
matrices, convolution kernels, embeddings, positional tables — is a ``weight``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from dynamics.params.globs import glob_any, glob_match

#: The named groupings: ``"kind"`` (bias, weight, normalization) or ``"layer"`` (the module
#: that owns each parameter).
Grouping = Literal["kind", "layer"]

BIAS, WEIGHT, NORMALIZATION = "bias", "weight", "normalization"
KINDS = (BIAS, WEIGHT, NORMALIZATION)
#: The group of parameters that match none of a user's patterns.
OTHER = "other"


@dataclass(frozen=True)
class ParameterGroups:
    """Group names and, per trainable parameter (in ``named_parameters`` order), its group.

    Example::

        groups = group_parameters(model, "layer")
        groups.names, groups.members(groups.names[0])

    Attributes:
        names: the groups that hold at least one parameter, in a stable order.
        parameters: the trainable parameters' names.
        index: for each of ``parameters``, the position of its group in ``names``.
    """

    names: tuple[str, ...]
    parameters: tuple[str, ...]
    index: tuple[int, ...]

    def members(self, group: str) -> list[str]:
        """The parameters of ``group``."""
        position = self.names.index(group)
        return [p for p, i in zip(self.parameters, self.index) if i == position]


def is_bias(name: str) -> bool:
    """Whether a parameter's own name names a bias: ``bias``, ``bias_*`` (LSTM/GRU
    ``bias_ih_l0``, attention's ``bias_k``) or ``*_bias`` (attention's ``in_proj_bias``).

    Example::

        is_bias("bias"), is_bias("bias_ih_l0"), is_bias("weight")  # True, True, False
    """
    return name == "bias" or name.startswith("bias_") or name.endswith("_bias")


def parameter_kind(module: nn.Module, name: str, parameter: nn.Parameter) -> str:
    """``bias``, ``weight`` or ``normalization`` for ``module``'s own parameter ``name``."""
    if "Norm" in type(module).__name__:
        return NORMALIZATION
    return BIAS if is_bias(name) and parameter.dim() == 1 else WEIGHT


def group_parameters(
    module: nn.Module, groups: Grouping | Mapping[str, Sequence[str]] = "kind"
) -> ParameterGroups:
    """The groups of ``module``'s trainable parameters.

    Example::

        groups = group_parameters(model)  # bias, weight, normalization
        groups.members("bias")
        group_parameters(model, {"attn": ["**.attn.**"]}).names  # "attn", and "other" for the rest

    Args:
        module: the model.
        groups: ``"kind"`` (see the module docstring), ``"layer"`` (one group per module that
            owns parameters, named by its dotted name, ``"(root)"`` for the model's own), or
            ``{group: [glob, ...]}`` matched against dotted parameter names with
            :mod:`dynamics.params.globs` (``"**.bias"``, ``"blocks.*.fc1.*"``); a parameter goes to
            the first group with a matching pattern, and to ``"other"`` if none matches.

    Raises:
        ValueError: an unknown grouping, a pattern group that matches no parameter, a group
            named ``"other"``, or a module without trainable parameters.
    """
    owned = [
        (f"{owner_name}.{name}" if owner_name else name, owner_name, owner, name, parameter)
        for owner_name, owner in module.named_modules()
        for name, parameter in owner.named_parameters(recurse=False)
        if parameter.requires_grad
    ]
    # named_modules visits shared modules once; named_parameters also drops tied duplicates,
    # so the order (and membership) follows named_parameters.
    order = [n for n, p in module.named_parameters() if p.requires_grad]
    by_name = {full: (owner_name, owner, name, p) for full, owner_name, owner, name, p in owned}
    if not order:
        raise ValueError(f"{type(module).__name__} has no trainable parameter to group")
    if isinstance(groups, str):
        if groups == "kind":
            assigned = {n: parameter_kind(*by_name[n][1:]) for n in order}
            names = tuple(k for k in KINDS if k in assigned.values())
        elif groups == "layer":
            assigned = {n: by_name[n][0] or "(root)" for n in order}
            names = tuple(dict.fromkeys(assigned[n] for n in order))
        else:
            raise ValueError(f"groups must be 'kind', 'layer' or a mapping, got {groups!r}")
    else:
        assigned = _by_patterns(order, groups)
        names = tuple(g for g in [*groups, OTHER] if g in assigned.values())
    return ParameterGroups(names, tuple(order), tuple(names.index(assigned[n]) for n in order))


def _by_patterns(order: list[str], groups: Mapping[str, Sequence[str]]) -> dict[str, str]:
    if OTHER in groups:
        raise ValueError(f"the group name {OTHER!r} is kept for parameters no pattern matches")
    for group, patterns in groups.items():
        if isinstance(patterns, str):
            raise ValueError(
                f"group {group!r}: give a list of patterns, got the string {patterns!r}"
            )
        if not any(glob_match(n, p) for n in order for p in patterns):
            raise ValueError(f"group {group!r}: no parameter matches {list(patterns)}")
    return {
        n: next((g for g, patterns in groups.items() if glob_any(n, patterns)), OTHER)
        for n in order
    }
