"""The experiments ``dynamics run`` trains, found by the name in a config's ``experiment:`` key.

The built-ins are a table of ``name -> "module:class"`` (:data:`BUILTINS`), imported on first
use: nothing here imports an experiment, so the experiments may import what they need from the
package without an import circle, and rebuilding a recorded module by its class path loads no
recorder or probe. An experiment defined elsewhere (a user's, a test's) is made known with
:func:`register`.
"""

from __future__ import annotations

import importlib

from dynamics.errors import DynamicsError
from dynamics.experiments.experiment import Experiment

#: The built-in experiments: config name -> ``"module:class"`` of its :class:`Experiment`.
BUILTINS: dict[str, str] = {
    "teacher_student": "dynamics.experiments.teacher_student.experiment:TeacherStudent",
    "autoencoder": "dynamics.experiments.autoencoder.experiment:Autoencoder",
    "char_gpt": "dynamics.experiments.char_gpt.experiment:CharGPTExperiment",
    "vit_digits": "dynamics.experiments.vit_digits.experiment:ViTDigitsExperiment",
}

#: Experiments in use: the built-ins once asked for, and every registered one.
_EXPERIMENTS: dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    """Make ``experiment`` available to configs under ``experiment.name``; returns it.

    Example::

        MY_EXPERIMENT = register(MyExperiment())  # configs then say `experiment: mine`

    Raises:
        ValueError: another experiment has that name (a programming error).
    """
    if experiment.name in _EXPERIMENTS or experiment.name in BUILTINS:
        raise ValueError(f"an experiment named {experiment.name!r} is already registered")
    _EXPERIMENTS[experiment.name] = experiment
    return experiment


def get(name: str) -> Experiment:
    """The experiment registered under ``name`` (a built-in is imported on first use).

    Example::

        experiment = get("teacher_student")

    Raises:
        DynamicsError: no experiment has that name (the message lists the known ones).
    """
    if name not in _EXPERIMENTS:
        if name not in BUILTINS:
            raise DynamicsError(f"unknown experiment {name!r}; known: {', '.join(known())}")
        module, _, attribute = BUILTINS[name].partition(":")
        _EXPERIMENTS[name] = getattr(importlib.import_module(module), attribute)()
    return _EXPERIMENTS[name]


def known() -> list[str]:
    """The names of every experiment, built-in or registered, sorted."""
    return sorted({*BUILTINS, *_EXPERIMENTS})
