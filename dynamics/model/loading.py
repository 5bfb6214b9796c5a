"""Loading a stored state of a run into a module, after checking that the module is the run's:
its submodules (class and settings) and its frozen parameters.

Example::

    import dynamics
    from dynamics.model import load_into

    run = dynamics.open_run("runs/demo/unshifted.h5")
    state = load_into(run, model, step=100)  # the stored state nearest step 100
"""

from __future__ import annotations

import warnings

from torch import nn

from dynamics.errors import DynamicsError, ParameterError
from dynamics.model.record import builds_in_configure_model
from dynamics.params.layout import BufferLayout
from dynamics.params.naming import named_submodules
from dynamics.params.vectors import frozen_hash, load_state
from dynamics.store import Run, RunFileError, StoredState, names


def load_into(run: Run, model: nn.Module, step: int | None = None) -> StoredState:
    """Load a stored state into ``model`` in place: its parameters and buffers.

    Example::

        model = MyModule(**run.attrs["module"]["init_args"])
        state = load_into(run, model, step=500)  # the stored state nearest step 500
        state.step

    Args:
        model: a module of the run's parameter layout (its own instance, or
            :func:`~dynamics.model.rebuild.rebuild_module`'s).
        step: the stored state nearest this optimizer step is loaded (θ0 counts as step
            0, θT as the run's number of steps; the earlier on a tie); None: θT, or the
            latest state stored when the run ended before storing θT.

    Returns:
        The state loaded.

    Raises:
        RunFileError: the run stores no θ0 or no parameter layout.
        DynamicsError: the model's parameters, buffers or submodules (class and settings,
            e.g. a shifted activation) differ from the run's, or its frozen parameters
            (which the file holds only as a hash) are not the run's.

    Warns:
        UserWarning: the model has persistent buffers and the run recorded none: the model
            keeps its own (e.g. BatchNorm's initial running statistics), not the run's.
    """
    if run.layout is None:
        raise RunFileError(f"{run.path.name}: no parameter layout recorded")
    differing = submodule_differences(run, model)
    if differing:
        # The same parameters in a module of other activations (a run shifted by
        # ShiftActivations loaded into the unshifted class) compute other losses silently.
        advice = (
            "call model.configure_model() first, which builds its layers, or load into "
            if builds_in_configure_model(model)
            else "load into "
        )
        raise DynamicsError(
            f"{run.path.name}: the model's submodules differ from the run's "
            f"({differing}); {advice}dynamics.model.rebuild_module(run), which replays "
            "what callbacks did to the module at fit time"
        )
    check_frozen_parameters(run, model)
    states = run.stored_states()
    state = states[-1] if step is None else min(states, key=lambda s: abs(s.step - step))
    try:
        load_state(model, state.theta, run.layout, state.buffers, run.buffer_layout)
    except ValueError as error:
        raise DynamicsError(f"{run.path.name}: the model differs from the run's: {error}") from None
    if state.buffers is None and BufferLayout.of(model).names:
        warnings.warn(
            f"{run.path.name}: no buffers recorded; the model keeps its own", stacklevel=2
        )
    return state


def check_frozen_parameters(run: Run, model: nn.Module) -> None:
    """Refuse ``model`` if its frozen parameters (``requires_grad=False``) are not the run's.

    The run file stores only their hash (at θ0): a model whose constructor draws them
    afresh, rather than loading what the run had, would compute other losses silently.

    Raises:
        DynamicsError: they differ from the run's (or the model has none and the run had).
    """
    recorded = run.attrs.get(names.ATTR_FROZEN_SHA256)
    if recorded is not None and frozen_hash(model) != recorded:
        factory = ParameterError("model", "a factory that does")
        raise DynamicsError(
            f"{run.path.name}: the model's frozen parameters (requires_grad=False) are not "
            "the run's, which the run file holds only as a hash; build the model so that "
            f"it has them (the same pretrained weights or seed), or pass {factory}"
        ).quoting(factory)


def submodule_differences(run: Run, model: nn.Module) -> str:
    """Where ``model``'s submodules differ in class or settings from those the run
    recorded at fit time, as text naming the first three; ``""`` when they agree or the
    run recorded none (files from before they were recorded).

    Classes are compared by their own name: a class loaded from a file lives in a module
    of another name than the training script's.
    """
    recorded = run.attrs.get(names.ATTR_SUBMODULES)
    if not isinstance(recorded, dict):
        return ""
    found = {
        name: [type(child).__name__, child.extra_repr()] for name, child in named_submodules(model)
    }
    recorded = {name: [path.rsplit(".", 1)[-1], text] for name, (path, text) in recorded.items()}
    differing = [
        n for n in sorted(found.keys() | recorded.keys()) if found.get(n) != recorded.get(n)
    ]
    shown = "; ".join(
        f"{n}: {_module_text(recorded.get(n))} in the run, {_module_text(found.get(n))} here"
        for n in differing[:3]
    )
    return shown + (f"; and {len(differing) - 3} more" if len(differing) > 3 else "")


def _module_text(record: list[str] | None) -> str:
    return "absent" if record is None else f"{record[0]}({record[1]})"
