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

A tree read from a run file or a checkpoint is untrusted data: rebuilding it imports, constructs
and calls nothing that the tree names. A named tuple comes back as a plain named tuple of the
stored name and fields, made here (``batch.x`` reads the same); only a caller holding the live
batch passes its classes back (:func:`named_tuple_classes`).
"""

from __future__ import annotations

import collections
import keyword
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_VALUES = (type(None), bool, int, float, str)
#: Bounds on a stored named tuple's name and fields: far beyond any batch, small enough that a
#: crafted tree cannot make building the class costly.
MAX_FIELDS = 256
MAX_NAME_CHARS = 128
MAX_DEPTH = 64


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


def named_tuple_classes(batch: Any) -> dict[str, type]:
    """``{stored path: class}`` of the named tuples inside a live batch, for
    :func:`unflatten_batch` to give them back as their own classes."""
    found: dict[str, type] = {}

    def visit(value: Any) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                found[_type_path(value)] = type(value)
            for item in value:
                visit(item)

    visit(batch)
    return found


def unflatten_batch(
    tree: Mapping[str, Any],
    leaves: list[torch.Tensor],
    named_tuples: Mapping[str, type] | None = None,
) -> Any:
    """The batch :func:`flatten_batch` described, its leaves replaced by ``leaves``.

    A named tuple comes back as the class ``named_tuples`` gives for its stored path (from
    :func:`named_tuple_classes` of the live batch), else as a plain named tuple of the same name
    and fields, made here: nothing the tree names is imported. A mapping comes back as a
    ``dict``.

    Raises:
        ValueError: the tree holds an object of an unsupported type, names a leaf that
            ``leaves`` lacks, or is not a tree :func:`flatten_batch` makes.
    """
    known = named_tuples or {}

    def rebuild(node: Any, depth: int) -> Any:
        if not isinstance(node, Mapping) or not node:
            raise ValueError(f"the batch's tree holds {str(node)[:60]!r}, not a node")
        if depth > MAX_DEPTH:
            raise ValueError(f"the batch's tree nests deeper than {MAX_DEPTH} containers")
        (kind, content), *_ = node.items()
        if kind == "tensor":
            if not isinstance(content, int) or isinstance(content, bool) or content < 0:
                raise ValueError(f"the batch's tree names tensor {content!r}, not an index")
            if content >= len(leaves):
                raise ValueError(
                    f"the batch's tree names tensor {content}, only {len(leaves)} stored"
                )
            return leaves[content]
        if kind == "value":
            if not isinstance(content, _VALUES):
                raise ValueError(f"the batch's tree holds the value {str(content)[:60]!r}")
            return content
        if kind in ("list", "tuple", "dict") and not isinstance(content, list):
            raise ValueError(f"the batch's tree holds a {kind} of {str(content)[:60]!r}")
        if kind == "list":
            return [rebuild(n, depth + 1) for n in content]
        if kind == "tuple":
            return tuple(rebuild(n, depth + 1) for n in content)
        if kind == "dict":
            if not all(
                isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], _VALUES)
                for pair in content
            ):
                raise ValueError("the batch's tree holds a dict whose items are not [key, node]")
            return {key: rebuild(n, depth + 1) for key, n in content}
        if kind == "namedtuple":
            fields, items = node.get("fields"), node.get("items")
            if not (isinstance(content, str) and isinstance(fields, list)):
                raise ValueError("the batch's tree holds a named tuple without a name and fields")
            if not isinstance(items, list) or len(items) != len(fields):
                raise ValueError(
                    "the batch's tree holds a named tuple whose items and fields differ"
                )
            cls = _named_tuple_class(content, fields, known)
            return cls(*(rebuild(n, depth + 1) for n in items))
        if kind == "unsupported":
            raise ValueError(
                f"the probe batch holds a {str(content)[:120]}, which dynamics cannot store; give "
                "GradientPlane a batch of dicts, lists and tuples of tensors "
                "(GradientPlane(batch=...))"
            )
        raise ValueError(f"the batch's tree holds a node of the unknown kind {str(kind)[:60]!r}")

    return rebuild(tree, 0)


def _type_path(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _named_tuple_class(path: str, fields: list[str], known: Mapping[str, type]) -> type:
    """The class of a stored named tuple: the caller's own for ``path``, else one made here
    from the stored name and fields alone (checked to be identifiers, as few as a batch has)."""
    cls = known.get(path)
    if cls is not None and getattr(cls, "_fields", None) == tuple(fields):
        return cls
    name = path.rpartition(".")[2]
    words = [name, *fields]
    if (
        len(fields) > MAX_FIELDS
        or not all(isinstance(w, str) and len(w) <= MAX_NAME_CHARS for w in words)
        or not all(w.isidentifier() and not keyword.iskeyword(w) for w in words)
        or any(f.startswith("_") for f in fields)
        or len(set(fields)) != len(fields)
    ):
        raise ValueError(
            f"the batch's tree holds a named tuple {str(path)[:MAX_NAME_CHARS]!r} whose name or "
            f"fields are not {MAX_FIELDS} or fewer distinct identifiers"
        )
    return collections.namedtuple(name, fields)
