"""``--set KEY=VALUE``: config overrides on the command line, for ``run`` and ``reproduce``."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from dynamics.errors import ParameterError


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--set KEY=VALUE`` to ``parser`` (as ``args.set``)."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, dotted (optimizer.lr=1e-2, model.activation=gelu); "
        "the value is read as YAML and checked as the file's key; repeatable",
    )


def set_overrides(texts: list[str], flags: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{dotted key: value}`` of every ``--set`` text, over the keys ``flags`` give (a flag's
    None gives nothing).

    Example::

        set_overrides(["optimizer.lr=1e-2"], {"steps": 30})  # {"steps": 30, "optimizer.lr": 0.01}

    Raises:
        ParameterError: naming ``--set``: a malformed text, a key given twice, or a key a flag
            also gives.
    """
    from dynamics.experiments.overrides import parse_assignment

    overrides = {key: value for key, value in (flags or {}).items() if value is not None}
    given: set[str] = set()
    for text in texts:
        key, value = parse_assignment(text, parameter="set")
        if key in given:
            raise ParameterError("set", f"{key} is given twice")
        if key in overrides:
            raise ParameterError("set", f"{key} is also given by its own flag; give it once")
        given.add(key)
        overrides[key] = value
    return overrides


def overrides_text(config: Mapping[str, Any] | None) -> str | None:
    """A recorded config's applied overrides as ``--set`` spells them
    (``"optimizer.lr=0.01, model.activation=gelu"``); None when it records none.

    Example::

        overrides_text({"overrides": {"optimizer.lr": 0.01}})  # "optimizer.lr=0.01"
    """
    import json

    overrides = (config or {}).get("overrides") or {}
    if not isinstance(overrides, Mapping) or not overrides:
        return None
    # a string as typed, anything else as the YAML/JSON the value reads back as
    return ", ".join(
        f"{key}={value if isinstance(value, str) else json.dumps(value)}"
        for key, value in overrides.items()
    )
