"""Config files: YAML over an experiment's defaults, found by path or by a shipped name.

The shipped configs are ``configs/*.yaml`` of the source tree (the one copy), installed as the
package data of ``dynamics.configs``, so ``dynamics run teacher_student`` works wherever the
package is installed; each file's first comment line says in one line what it is. Unknown keys
and values of the wrong type are refused with one line naming the key.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from dynamics.errors import ParameterError
from dynamics.experiments.config import (
    DEFAULT_EXPERIMENT,
    INT64_MAX,
    ConfigError,
    ExperimentConfig,
)
from dynamics.experiments.experiment import Experiment
from dynamics.experiments.registry import get

#: The package whose data files are the shipped configs.
CONFIG_PACKAGE = "dynamics.configs"
#: The key a run's config records its applied overrides under (never read from a file).
OVERRIDES = "overrides"
#: What a shipped config without an experiment is run with (it configures the Trainer itself).
LIGHTNING_CLI = "LightningCLI"


def load_config(
    config: str | Path | None = None, **overrides: Any
) -> tuple[Experiment, ExperimentConfig]:
    """Read a YAML config (a file, or a shipped config by name: :func:`config_file`) over its
    experiment's defaults, then apply dotted ``overrides``.

    The ``experiment:`` key names the experiment (:data:`DEFAULT_EXPERIMENT` when absent); the
    other keys are that experiment's config. An override such as ``optimizer.lr`` is checked
    like the same key in the file; None leaves the key as it is. No config: the default
    experiment's defaults.

    Example::

        experiment, config = load_config("teacher_student", steps=200, **{"optimizer.lr": 3e-4})
        experiment, config = load_config("my_configs/wide.yaml")

    Returns:
        The experiment and its validated config.

    Raises:
        DynamicsError: missing or unreadable file, unknown name, unknown experiment, unknown
            key, wrong type or bad value.
    """
    path = None if config is None else config_file(config)
    data: dict[str, Any] = {}
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"config {path}: no such file")
        try:
            data = yaml.load(path.read_text(), Loader=_UniqueKeysLoader) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"config {path}: not valid YAML ({_first_line(error)})") from None
        except ConfigError as error:
            raise ConfigError(f"config {path}: {error}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path}: expected a mapping at the top level")
        if "trainer" in data and "experiment" not in data:
            raise ConfigError(
                f"config {path}: a LightningCLI config (its trainer: section), not an "
                "experiment's; run it with LightningCLI's fit --config"
            )
    if "seed" in data and "seeds" in data:
        raise ConfigError(f"config {path}: give seed or seeds, not both")
    # A seed given as an override replaces the file's seeds, and seeds its seed.
    for key, other in (("seed", "seeds"), ("seeds", "seed")):
        if overrides.get(key) is not None:
            if overrides.get(other) is not None:
                raise ConfigError("give seed or seeds, not both")
            data.pop(other, None)
    name = data.pop("experiment", DEFAULT_EXPERIMENT)
    if not isinstance(name, str):
        raise ConfigError(f"config key 'experiment' must be an experiment name, got {name!r}")
    experiment = get(name)
    for old, new in experiment.config_class.moved_keys.items():
        if old in data:
            raise ConfigError(f"config key {old!r} is now {new!r}")
    applied = {dotted: value for dotted, value in overrides.items() if value is not None}
    for dotted, value in applied.items():
        _override(data, dotted, value, experiment.config_class)
    if OVERRIDES in data:
        raise ConfigError(
            f"config key {OVERRIDES!r} is what a run records of its --set overrides, not a key "
            "to set; set the keys themselves"
        )
    config = _build(experiment.config_class, data, "")
    # seeds is the group's (each run records its own seed), so not a run's override
    config.overrides = {k: v for k, v in applied.items() if k != "seeds"}
    steps = config.steps
    if "steps" in applied and "eval_every" not in applied and 0 < steps < config.eval_every:
        # validate() would blame the file's eval_every for the steps the caller asked for
        raise ParameterError(
            "steps",
            f"must be at least the config's eval_every ({config.eval_every}), or no held-out "
            f"loss is ever measured, got {steps}; for fewer steps add --set eval_every=N "
            f"(N <= {steps})",
        )
    return experiment, config.validate()


class _UniqueKeysLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in a mapping (YAML keeps the last
    silently, so a second ``record:`` would drop every key of the first)."""


def _unique_keys_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise ConfigError(f"key {key!r} is given twice in one mapping (line {line})")
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeysLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_keys_mapping
)


def _override(data: dict[str, Any], dotted: str, value: Any, cls: type | None) -> None:
    *parents, leaf = dotted.split(".")
    for depth, parent in enumerate(parents):
        default = getattr(cls(), parent, None) if cls is not None else None
        if parent not in data and isinstance(default, dict):
            # One key of a mapping field (variants.shifted): its other keys keep their defaults.
            data[parent] = dict(default)
        cls = type(default) if dataclasses.is_dataclass(default) else None
        data = data.setdefault(parent, {})
        if not isinstance(data, dict):
            raise ConfigError(f"config key {'.'.join(parents[: depth + 1])!r} must be a mapping")
    data[leaf] = value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}; known: {', '.join(known)}")
    values = {}
    for name, value in data.items():
        default = getattr(cls(), name)
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {key!r} must be a mapping")
            values[name] = _build(type(default), value, f"{key}.")
        else:
            values[name] = _checked(key, value, default)
    return cls(**values)


def _checked(key: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        if abs(value) > INT64_MAX:  # torch, numpy and HDF5 hold 64 bits
            raise ConfigError(f"config key {key!r} must fit in 64 bits, got {value}")
    if isinstance(default, float):
        value = _yaml_float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
        return float(value)
    if isinstance(default, dict) and not isinstance(value, dict):
        raise ConfigError(f"config key {key!r} must be a mapping, got {value!r}")
    return value


def _yaml_float(value: Any) -> Any:
    # YAML 1.1 reads 1e-3 (no dot) as a string; accept it as the number it plainly is.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]


@dataclass(frozen=True)
class ShippedConfig:
    """One shipped config: its name, what runs it, its one-line description and its file.

    Attributes:
        experiment: the experiment ``dynamics run`` trains, or :data:`LIGHTNING_CLI` for a
            config of LightningCLI's own (a ``trainer:`` section, ``class_path`` entries).
    """

    name: str
    experiment: str
    description: str
    path: Path


def configs_folder() -> Path:
    """The folder of the shipped configs (installed as files, not inside a zip)."""
    return Path(str(importlib.resources.files(CONFIG_PACKAGE)))


def shipped_configs() -> dict[str, ShippedConfig]:
    """Every shipped config by name, sorted.

    Example::

        for config in shipped_configs().values():
            print(config.name, config.experiment, config.description)
    """
    configs = {}
    for path in sorted(configs_folder().glob("*.yaml")):
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        if "trainer" in data and "experiment" not in data:
            experiment = LIGHTNING_CLI
        else:
            experiment = data.get("experiment", DEFAULT_EXPERIMENT)
        configs[path.stem] = ShippedConfig(path.stem, experiment, _description(text), path)
    return configs


def config_file(config: str | Path) -> Path:
    """The file of ``config``: an existing file, else the shipped config of that name.

    A name is a bare word (no folder, no suffix); anything else is a path, left for the loader
    to say it does not exist.

    Example::

        config_file("teacher_student")  # .../dynamics/configs/teacher_student.yaml
        config_file("my/config.yaml")  # my/config.yaml

    Raises:
        ConfigError: a bare word that is neither a file nor a shipped config (the message
            lists the shipped ones).
    """
    path = Path(config)
    if path.is_file() or path.suffix or len(path.parts) != 1:
        return path
    shipped = shipped_configs()
    if path.name not in shipped:
        raise ConfigError(
            f"config {path.name!r} is neither a file nor a shipped config ({', '.join(shipped)})"
        )
    return shipped[path.name].path


def _description(text: str) -> str:
    """The first comment line of a config file, without its ``#``."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""
