"""The loss of a run's model rebuilt from its file: what the plane views and the loss barriers
evaluate.

The model is rebuilt (:func:`~dynamics.model.rebuild.rebuild_module`) in eval mode, its loss
taken by the loss rule the run file keeps (:func:`~dynamics.model.rebuild.recorded_loss_rule`:
Lightning's, a Hugging Face model's ``model(**batch).loss``, or a plain loop's loss function) on
the run's stored probe batch (or a given one), each point with the buffers (BatchNorm
statistics) of the nearest stored state (:mod:`dynamics.geometry.nearest_buffers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dynamics.errors import DynamicsError, one_line
from dynamics.geometry.landscape import LossSurface
from dynamics.geometry.nearest_buffers import NearestBuffers
from dynamics.model.probe_batch import probe_batch
from dynamics.model.rebuild import RunInitArgs, rebuild_module, recorded_loss_rule
from dynamics.passes.loss_rule import LossUnavailable
from dynamics.store import Run, names

__all__ = ["BatchRefused", "rebuilt_surface"]


class BatchRefused(DynamicsError):
    """The rebuilt model cannot take the batch its loss is to be evaluated on."""


def rebuilt_surface(
    run: Run,
    model: str | None = None,
    init_args: dict | RunInitArgs | None = None,
    trust: bool = False,
    *,
    buffers_of: Sequence[Run] = (),
    batch: Any = None,
    batch_name: str = "the stored probe batch",
) -> LossSurface:
    """The loss of ``run``'s model rebuilt from its file, on its stored probe batch (or
    ``batch``), in eval mode, each point with the buffers of the nearest stored state (of
    ``run``, or of the runs ``buffers_of`` when given: a path between runs' endpoints).

    Args:
        run: the run whose model and probe batch are used.
        model: build this class or factory instead (see
        :func:`~dynamics.model.rebuild.rebuild_module`).
        init_args: init args completing or overriding the recorded ones (see
            :func:`~dynamics.model.rebuild.rebuild_module`).
        trust: import a recorded class (or loss function) from outside the installed packages.
        buffers_of: the runs whose stored states supply buffers; default ``run``'s.
        batch: the batch to evaluate on instead of the stored probe batch (on the CPU).
        batch_name: what the batch is, for the error saying the model cannot take it.

    Raises:
        DynamicsError: the model cannot be rebuilt, has no loss to evaluate (the run's loss rule
            gives none, or names a function that cannot or may not be imported), or the run
            stores no probe batch (and no ``batch`` is given).
        BatchRefused: the model cannot take the batch (tried once, at θ0).

    Example::

        surface = rebuilt_surface(open_run("runs/a.h5"))
        surface.loss(open_run("runs/a.h5").vector("theta0"))
    """
    rule = recorded_loss_rule(run, trust)  # before the model: a refusal costs no build
    module = rebuild_module(run, model, init_args, trust)
    try:  # before any pass: a manually optimized module's training_step would train it
        rule.check(module)
    except LossUnavailable as error:
        raise DynamicsError(f"{run.path.name}: {error}") from None
    buffers = NearestBuffers.of_runs(list(buffers_of) or [run], module)
    if batch is None:
        batch = probe_batch(run)
    surface = LossSurface(module, run.layout, batch, rule, buffers=buffers)
    theta0 = run.vector(names.THETA0)  # the plane's checks have asked for it already
    try:  # once at θ0, so a batch the model cannot take is one line, not a worker's
        if theta0 is not None:
            surface.loss(theta0)
    except LossUnavailable as error:  # the model, not the batch (a step that reads self.trainer)
        raise DynamicsError(f"{run.path.name}: {error}") from None
    # KeyError and AttributeError: a dict or object batch without what the step reads.
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError) as error:
        raise BatchRefused(
            f"{run.path.name}: the rebuilt model cannot take {batch_name}: {one_line(error)}"
        ) from None
    return surface
