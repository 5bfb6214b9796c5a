"""Config overrides as the command line spells them: ``KEY=VALUE`` and ``KEY=V1,V2,...``.

A value is read as YAML reads the same value in a config file (``1e-3`` a number, ``true`` a
boolean, ``[0.9, 0.99]`` a list, ``gelu`` a string), so an override is checked exactly as the
file's key would be, by :func:`~dynamics.experiments.config_files.load_config`.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from dynamics.errors import ParameterError


def parse_assignment(text: str, parameter: str = "set") -> tuple[str, Any]:
    """``"optimizer.lr=1e-2"`` as ``("optimizer.lr", 0.01)``.

    Example::

        parse_assignment("model.activation=gelu")  # ("model.activation", "gelu")
        parse_assignment("optimizer.betas=[0.9, 0.95]")  # ("optimizer.betas", [0.9, 0.95])

    Raises:
        ParameterError: naming ``parameter``: no ``=``, an empty or malformed key, no value,
            or a value YAML cannot read.
    """
    key, value = _split(text, parameter)
    return key, parse_value(value, parameter, key)


def parse_choices(text: str, parameter: str = "grid") -> tuple[str, list[Any]]:
    """``"optimizer.lr=3e-4,1e-3"`` as ``("optimizer.lr", [0.0003, 0.001])``: a grid axis.

    The values are split at top-level commas (a bracketed list such as ``[0.9,0.99]`` is one
    value) and each is read as :func:`parse_assignment` reads one.

    Example::

        parse_choices("optimizer.name=adam,sgd")  # ("optimizer.name", ["adam", "sgd"])

    Raises:
        ParameterError: naming ``parameter``: as :func:`parse_assignment`, or a value given
            twice.
    """
    key, values = _split(text, parameter)
    choices = [parse_value(value, parameter, key) for value in _top_level_split(values)]
    for index, choice in enumerate(choices):
        if choice in choices[:index]:
            raise ParameterError(parameter, f"{key}: the value {choice!r} is given twice")
    return key, choices


def parse_value(text: str, parameter: str = "set", key: str = "") -> Any:
    """One override value read as YAML reads it in a config file.

    Raises:
        ParameterError: an empty value or one YAML cannot read.
    """
    where = f"{key}: " if key else ""
    if not text.strip():
        raise ParameterError(parameter, f"{where}needs a value after '='")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        first = str(error).strip().splitlines()[0]
        raise ParameterError(parameter, f"{where}{text!r} is not a value ({first})") from None
    # YAML 1.1 reads 1e-3 (no dot) as a string; it is plainly the number (as YAML 1.2 reads it).
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _split(text: str, parameter: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    key = key.strip()
    if not equals:
        raise ParameterError(parameter, f"must be KEY=VALUE (e.g. optimizer.lr=1e-2), got {text!r}")
    if not key or not all(part.replace("_", "").isalnum() for part in key.split(".")):
        raise ParameterError(
            parameter, f"key {key!r} must be dotted config keys such as optimizer.lr"
        )
    return key, value


def _top_level_split(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and braces."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


__all__ = ["parse_assignment", "parse_choices", "parse_value"]
