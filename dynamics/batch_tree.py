"""A batch's structure as JSON, so a stored batch is rebuilt exactly as training saw it.

A probe batch is stored as its tensor leaves (vectors ``probe_batch.<i>``) plus a JSON tree of
the containers around them: dicts (their keys and order), lists, tuples, named tuples, nested
in any way, with non-tensor values (numbers, strings, None) kept in place. A ``training_step``
that reads ``batch["x"]`` or ``batch.x`` then reads the same thing offline.

Node forms: ``{"tensor": i}`` (the i-th leaf), ``{"value": v}``, ``{"list": [...]}``,
``{"tuple": [...]}``, ``{"dict": [[key, node], ...]}`` (a list, so key order and non-string keys
survive JSON), ``{"namedtuple": "module.Name", "fields": [...], "items": [...]}``, and
``{"unsupported": "module.Type"}`` for any other object (a dataclass, a custom batch class):
it cannot be rebuilt, and its tensors are not stored.
"""

from __future__ import annotations

import collections
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_VALUES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class ForwardArguments:
    """The positional and keyword arguments of one forward call, for an example input that is
    not one positional argument (a Hugging Face model takes ``input_ids=...``)."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def tree(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)``: a batch tree :func:`flatten_batch` takes."""
        return self.args, dict(self.kwargs)


def call_forward(module: Any, example_input: Any) -> Any:
    """``module(example_input)``, or with the arguments of a :class:`ForwardArguments`."""
    if isinstance(example_input, ForwardArguments):
        return module(*example_input.args, **example_input.kwargs)
    return module(example_input)


def flatten_batch(batch: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The batch's tree (JSON-serializable) and its tensor leaves, in the tree's order."""
    leaves: list[torch.Tensor] = []

    def node(value: Any) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            leaves.append(value)
            return {"tensor": len(leaves) - 1}
        if isinstance(value, _VALUES):
            return {"value": value}
        if isinstance(value, Mapping):
            if all(isinstance(k, _VALUES) for k in value):
                return {"dict": [[k, node(v)] for k, v in value.items()]}
        elif isinstance(value, tuple) and hasattr(value, "_fields"):
            return {
                "namedtuple": _type_path(value),
                "fields": list(value._fields),
                "items": [node(v) for v in value],
            }
        elif type(value) in (list, tuple):
            return {type(value).__name__: [node(v) for v in value]}
        return {"unsupported": _type_path(value)}

    return node(batch), leaves


def unflatten_batch(tree: Mapping[str, Any], leaves: list[torch.Tensor]) -> Any:
    """The batch :func:`flatten_batch` described, its leaves replaced by ``leaves``.

    A named tuple comes back as its own class when that imports, else as a named tuple of the
    same name and fields; a mapping comes back as a ``dict``.

    Raises:
        ValueError: the tree holds an object of an unsupported type, or names a leaf that
            ``leaves`` lacks.
    """
    (kind, content), *_ = tree.items()
    if kind == "tensor":
        if content >= len(leaves):
            raise ValueError(f"the batch's tree names tensor {content}, only {len(leaves)} stored")
        return leaves[content]
    if kind == "value":
        return content
    if kind == "list":
        return [unflatten_batch(n, leaves) for n in content]
    if kind == "tuple":
        return tuple(unflatten_batch(n, leaves) for n in content)
    if kind == "dict":
        return {key: unflatten_batch(n, leaves) for key, n in content}
    if kind == "namedtuple":
        cls = _named_tuple_class(content, tree["fields"])
        return cls(*(unflatten_batch(n, leaves) for n in tree["items"]))
    raise ValueError(
        f"the probe batch holds a {content}, which dynamics cannot store; give GradientPlane "
        "a batch of dicts, lists and tuples of tensors (GradientPlane(batch=...))"
    )


def _type_path(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _named_tuple_class(path: str, fields: list[str]) -> type:
    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        cls = None
    if isinstance(cls, type) and getattr(cls, "_fields", None) == tuple(fields):
        return cls
    return collections.namedtuple(name, fields)
