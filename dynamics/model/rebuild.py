"""Rebuilding a run's model offline from what the run file recorded at fit time.

At fit time the recorder stores the module's class path and init args (:func:`module_record`):
the hyperparameters Lightning saved (``save_hyperparameters``), and the names of the
``__init__`` arguments it did not save or that JSON cannot hold. That is all that can be known:
an argument that was not saved may have had its default or any other value. So
:func:`rebuild_module` refuses a class whose init args are incomplete rather than fill them
with defaults (a different width fails on shapes; a different label smoothing gives wrong
losses silently) and says what to pass instead: the missing args as JSON, or a factory.
A Hugging Face model (``transformers.PreTrainedModel``) is the exception that needs none: its
config is recorded whole, and the model is rebuilt as ``Model(ConfigClass.from_dict(...))``.

A class defined in the training script (``__main__``) or in a file that is not importable is
named with ``model="path/to/file.py:Class"``; a module of the working directory imports as it
would in ``python -c``.

A run file is data, and importing a module runs its code: the recorded class path is trusted
only when its top-level package is an installed distribution's (looked up in the installed
metadata, before anything is imported), and only a ``torch.nn.Module`` subclass is ever called.
Anything else (the working directory's modules, the standard library) needs the user's word:
``model=`` names the class or factory, or ``trust_recorded_model=True`` imports the recorded one.
A loss function the run's loss rule names (:func:`recorded_loss_rule`) is trusted the same way.

What callbacks did to the module at fit time is replayed (``model_edits``): activations
shifted by ``ShiftActivations`` are shifted again with the recorded settings, and each c is
checked against the recorded one, since a model rebuilt without its shift computes other losses
silently; biases set by ``InitBiases`` are in θ0 already. The rebuilt model's submodules are
then checked, class and settings, against those recorded: a model edited in other ways after
it was built (``shift_activations`` called in the training script) is refused, not rebuilt
unedited.

Init args are data too (a crafted width or depth): the model is first built on the meta
device, which allocates no memory for its tensors, and refused before it is materialized when
its parameters are not the run's layout or its tensors need more memory than is free; a
constructor registering far more submodules than the run recorded is stopped while it runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dynamics.bias.activations import ShiftedActivation
from dynamics.bias.shift import shift_activations
from dynamics.errors import DynamicsError, ParameterError, one_line
from dynamics.model.loading import check_frozen_parameters, submodule_differences
from dynamics.model.record import builds_in_configure_model, init_parameters, is_pretrained_config
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import load_state
from dynamics.passes.loss_rule import LossRule, LossUnavailable, loss_rule_from_dict
from dynamics.store import Run, names
from dynamics.system import available_bytes, check_fits

#: Classes that moved, by the class path older run files record -> where the class is now, so
#: a run recorded before a move still rebuilds: the one place a rename is written down (the old
#: paths are old on purpose; no import-path rewrite may touch them).
RENAMED_CLASSES: dict[str, str] = {
    # issue 23: dynamics/models.py split into the experiments' folders, one per experiment
    "dynamics.models.ResidualMLP": "dynamics.experiments.teacher_student.model.ResidualMLP",
    "dynamics.models.ResidualBlock": "dynamics.experiments.teacher_student.model.ResidualBlock",
    "dynamics.models.CharGPT": "dynamics.experiments.char_gpt.model.CharGPT",
    "dynamics.models.ViT": "dynamics.experiments.vit_digits.model.ViT",
    "dynamics.models.TransformerBlock": "dynamics.experiments.transformer.TransformerBlock",
    "dynamics.models.SelfAttention": "dynamics.experiments.transformer.SelfAttention",
    "dynamics.experiments.teacher_student.TeacherStudentModule": (
        "dynamics.experiments.teacher_student.module.TeacherStudentModule"
    ),
    "dynamics.experiments.char_gpt.CharGPTModule": (
        "dynamics.experiments.char_gpt.module.CharGPTModule"
    ),
    "dynamics.experiments.vit_digits.ViTDigitsModule": (
        "dynamics.experiments.vit_digits.module.ViTDigitsModule"
    ),
    "dynamics.experiments.autoencoder.AutoencoderModule": (
        "dynamics.experiments.autoencoder.module.AutoencoderModule"
    ),
}


@dataclass(frozen=True)
class RunInitArgs:
    """The init args given for rebuilding several runs together: ``shared`` by every run, and
    each run's own (``by_run``, keyed by its run file's path), merged over the shared ones.

    An argument a run did not record (no ``save_hyperparameters``) may have had another value
    in each run, so when several runs are rebuilt only a run's own args complete it: one set
    for all would rebuild a run trained with other args (another label smoothing) as another
    loss, silently. The shared args still override recorded ones, and are all a factory gets
    besides the run's own.

    Example::

        init_args = RunInitArgs(shared={"width": 64}, by_run={"a.h5": {"label_smoothing": 0.1}})
        model_a = rebuild_module(open_run("a.h5"), init_args=init_args.for_runs(["a.h5", "b.h5"]))
    """

    shared: Mapping[str, Any] = field(default_factory=dict)
    by_run: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Whether several runs are rebuilt (set by :meth:`for_runs`); one run's args are all its own.
    several: bool = False

    def for_runs(self, paths: Sequence[str | os.PathLike]) -> RunInitArgs:
        """These args for rebuilding the runs ``paths``, each key checked to name one of them.

        Raises:
            ParameterError: (of ``init_args``) a key names none of the runs.
        """
        resolved = {Path(p).resolve(): Path(p) for p in paths}
        by_run = {}
        for key, args in self.by_run.items():
            path = Path(key).resolve()
            if path not in resolved:
                given = ", ".join(str(p) for p in resolved.values())
                raise ParameterError("init_args", f"{key}=: not one of the runs given ({given})")
            by_run[str(path)] = args
        return RunInitArgs(self.shared, by_run, several=len(resolved) > 1)

    def own(self, run: Run) -> Mapping[str, Any]:
        """The args given for ``run`` by name."""
        return self.by_run.get(str(run.path.resolve()), {})

    def of(self, run: Run) -> dict[str, Any]:
        """Every arg given for ``run``: the shared ones, then its own over them."""
        return {**self.shared, **self.own(run)}

    def completing(self, run: Run) -> set[str]:
        """The args that may stand for ones ``run`` did not record."""
        return set(self.own(run)) | (set() if self.several else set(self.shared))


class MissingInitArgs(DynamicsError):
    """A run's init args were neither recorded nor given: the user's input is incomplete, so
    tools that otherwise note a run they cannot rebuild and go on refuse it."""


def run_init_args(
    init_args: Mapping[str, Any] | RunInitArgs | None, paths: Sequence[str | os.PathLike]
) -> RunInitArgs:
    """``init_args`` (a mapping: every run's) for rebuilding the runs ``paths`` together.

    Raises:
        DynamicsError: a run's own args name none of ``paths``.
    """
    if not isinstance(init_args, RunInitArgs):
        init_args = RunInitArgs(dict(init_args or {}))
    return init_args.for_runs(paths)


def rebuild_module(
    run: Run,
    model: str | None = None,
    init_args: Mapping[str, Any] | RunInitArgs | None = None,
    trust_recorded_model: bool = False,
) -> nn.Module:
    """The run's model at θ0, with θ0's buffers.

    Example::

        model = rebuild_module(open_run("runs/demo/shifted.h5"))  # at θ0, with θ0's buffers
        model = rebuild_module(run, model="train.py:MyNet", init_args={"width": 64})

    Args:
        run: the run file.
        model: what to build instead of importing the recorded class: ``"pkg.module:name"``
            or ``"path/to/file.py:name"``, a class (given the recorded init args, completed
            or overridden by ``init_args``) or a factory (given ``init_args`` only, and
            trusted to build the model as trained).
        init_args: init args that complete or override the recorded ones, or
            :class:`RunInitArgs` when several runs are rebuilt together.
        trust_recorded_model: import the recorded class even from outside the installed
            packages (the working directory's modules); it must still be a ``torch.nn.Module``.

    Raises:
        DynamicsError: the recorded class is outside the installed packages (without
            ``trust_recorded_model``) or not a ``torch.nn.Module`` subclass, the class or
            factory cannot be imported or called, init args are missing, a recorded model edit
            cannot be replayed (or its replayed shift has another constant c than recorded), or
            the model built differs from the run's parameters, buffers or submodules.
    """
    spec = run.attrs.get(names.ATTR_MODULE) or {}
    class_path = spec.get("class_path", "")
    if model:
        target = model_target(model)
    else:
        target = _recorded_class(run, class_path, trust_recorded_model)
        _check_module_class(run, class_path, target)
    if not isinstance(init_args, RunInitArgs):
        init_args = RunInitArgs(dict(init_args or {}))
    given = init_args.of(run)
    if inspect.isclass(target):
        args = {**(spec.get("init_args") or {}), **given}
        if spec.get("hf_config") and "config" not in given:
            args["config"] = _recorded_config(run, spec["hf_config"], trust_recorded_model)
        unrecorded = set(spec.get("unrecorded_init_args", ()))
        unrecorded |= {n for n in init_parameters(target) if n not in args}
        missing = sorted(unrecorded - init_args.completing(run))
        if missing:
            raise _missing_init_args(run, target, missing, init_args)
    else:
        args = given
    where = f"{run.path.name}: "
    _check_on_meta(run, target, args, where)
    with _BuildBounds.of(run, where):
        module = _built(target, args, where)
    # Before θ0 is loaded: a shifted activation holds its φ as a child, under another name.
    _replay_edits(run, module, given_model=bool(model))
    _load_theta0(run, module, args)
    check_frozen_parameters(run, module)
    _check_submodules(run, module)
    return module


def recorded_loss_rule(run: Run, trust_recorded_model: bool = False) -> LossRule:
    """The loss rule the run's probes took their losses by (root attr ``loss_rule``; the
    Lightning rule for files that keep none), for an offline tool to take the same loss.

    A loss function's module is imported under the rule for a recorded model class: only from
    an installed package, unless ``trust_recorded_model`` (then the working directory's modules
    import too); one defined in the training script (``__main__``) never.

    Example::

        rule = recorded_loss_rule(run)  # OutputLoss() for a Hugging Face Trainer's run
        loss = rule(rebuild_module(run), probe_batch(run))

    Raises:
        DynamicsError: the rule is unknown, or its function cannot or may not be imported.
    """
    record = run.attrs.get(names.ATTR_LOSS_RULE)
    if not isinstance(record, (Mapping, type(None))):
        raise DynamicsError(f"{run.path.name}: the run's loss rule is not a mapping: {record!r}")
    function = str((record or {}).get("function", ""))
    module_name = function.partition(":")[0]
    if module_name == "__main__":
        raise DynamicsError(
            f"{run.path.name}: the run's loss function {function} was defined in the training "
            "script (__main__), which cannot be imported; define it in a module to take the "
            "run's loss offline"
        )

    def importable(module_name: str) -> bool:
        top = module_name.split(".")[0]
        return trust_recorded_model or top in importlib.metadata.packages_distributions()

    if module_name and "<" not in function and not importable(module_name):
        trust = ParameterError("trust_recorded_model", "if you trust this file")
        raise DynamicsError(
            f"{run.path.name}: the run's loss function {function} is outside the installed "
            f"packages (importing it would run its code); pass {trust}"
        ).quoting(trust)
    try:
        with _importable_working_directory() if trust_recorded_model else contextlib.nullcontext():
            return loss_rule_from_dict(record, importable)
    except LossUnavailable as error:
        raise DynamicsError(f"{run.path.name}: {error}") from None
    except Exception as error:  # the user's module raised while importing
        raise DynamicsError(
            f"{run.path.name}: importing the run's loss function {function} failed: "
            f"{one_line(error)}"
        ) from None


def _missing_init_args(
    run: Run, target: type, missing: Sequence[str], init_args: RunInitArgs
) -> MissingInitArgs:
    """The refusal of a class whose init args ``missing`` were not recorded nor given."""
    example = json.dumps(dict.fromkeys(missing, "..."))
    unrecorded = (
        f"{run.path.name}: init args {', '.join(missing)} of {target.__qualname__} were not "
        "recorded (not saved with save_hyperparameters(), or not JSON)"
    )
    if init_args.several:
        shared = sorted(set(missing) & set(init_args.shared))
        why = (
            f"; args shared by several runs cannot say {', '.join(shared)} had the same value "
            "in each"
            if shared
            else ", and may differ between the runs"
        )
        own = ParameterError("init_args", f"{run.path}='{example}'")
        return MissingInitArgs(f"{unrecorded}{why}: give each run its own, {own}").quoting(own)
    given = ParameterError("init_args", f"'{example}'")
    factory = ParameterError("model", "pkg.module:function")
    return MissingInitArgs(
        f"{unrecorded}, and their defaults may not be the run's; pass them with {given}, or a "
        f"factory that builds the model with {factory}"
    ).quoting(given, factory)


def build_module(model: str, init_args: Mapping[str, Any] | None = None) -> nn.Module:
    """The module that the class or factory ``model`` (``pkg.module:name`` or
    ``path/to/file.py:name``, as :func:`rebuild_module`'s ``model``) builds from ``init_args``.

    Example::

        build_module("pkg.models:MyNet", {"width": 64})

    Raises:
        DynamicsError: it cannot be imported or called, or returns no ``torch.nn.Module``.
    """
    return _built(model_target(model), dict(init_args or {}), "")


#: How many times the run's recorded submodules a constructor may register: a few modules
#: built and discarded are usual, orders of magnitude more (a crafted depth) are not the run's.
_SUBMODULE_SLACK = 4


@dataclass
class _BuildBounds:
    """Stops a constructor that registers more submodules, or parameters and buffers of more
    bytes, than the bounds: each registration is counted by torch's global registration hooks,
    the first past a bound raises inside the constructor, and leaving the block raises the
    refusal in place of whatever the constructor made of that."""

    where: str
    recorded_submodules: int | None
    max_bytes: int
    submodules: int = 0
    tensor_bytes: int = 0
    exceeded: str = ""

    @classmethod
    def of(cls, run: Run, where: str) -> _BuildBounds:
        recorded = run.attrs.get(names.ATTR_SUBMODULES)
        return cls(where, len(recorded) if isinstance(recorded, dict) else None, available_bytes())

    def __enter__(self) -> _BuildBounds:
        registration = torch.nn.modules.module
        self._handles = [
            registration.register_module_module_registration_hook(self._submodule),
            registration.register_module_parameter_registration_hook(self._tensor),
            registration.register_module_buffer_registration_hook(self._tensor),
        ]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        if self.exceeded:
            raise DynamicsError(self.exceeded) from None

    def _submodule(self, module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        self.submodules += submodule is not None
        recorded = self.recorded_submodules
        if recorded is not None and self.submodules > _SUBMODULE_SLACK * recorded + 16:
            self._stop(
                f"registers more than {_SUBMODULE_SLACK * recorded + 16} submodules, the run "
                f"recorded {recorded}"
            )

    def _tensor(self, module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            self.tensor_bytes += tensor.numel() * tensor.element_size()
        if self.tensor_bytes > self.max_bytes:
            self._stop(
                f"needs more than {self.max_bytes / 2**30:,.1f} GiB for its parameters and "
                "buffers, the memory available"
            )

    def _stop(self, why: str) -> None:
        self.exceeded = self.exceeded or (
            f"{self.where}the model built from these init args {why}; were these the run's "
            "init args?"
        )
        raise MemoryError(self.exceeded)


def _check_on_meta(run: Run, target: Any, args: Mapping[str, Any], where: str) -> None:
    """Build the model on the meta device (no memory for its tensors) and refuse it before it
    is materialized: when its trainable parameters are not the run's layout, or its parameters
    and buffers need more memory than is available.

    A model that cannot be built on the meta device (its constructor computes with its
    tensors) is left to the real build, whose registrations are bounded all the same.
    """
    with _BuildBounds.of(run, where), torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                module = _built(target, args, where)
        except DynamicsError:
            module = None
    if module is None or run.layout is None:
        return
    built = ParameterLayout.of(module)
    if built != run.layout:
        try:
            run.layout.parameters(module)
            difference = (
                f"{len(built.names)} trainable tensors of {built.size:,} parameters, the run's "
                f"{len(run.layout.names)} of {run.layout.size:,}"
            )
        except ValueError as error:
            difference = str(error)
        raise DynamicsError(
            f"{where}the rebuilt model differs from the run's ({difference}); were these its "
            f"init args? {json.dumps(dict(args), default=str)[:200]}"
        )
    tensors = [*module.parameters(), *module.buffers()]
    check_fits(
        f"{where}the rebuilt model ({sum(t.numel() for t in tensors):,} values)",
        sum(t.numel() * t.element_size() for t in tensors),
    )


def _built(target: Any, args: Mapping[str, Any], where: str) -> nn.Module:
    name = getattr(target, "__qualname__", repr(target))
    try:
        module = target(**args)
    except Exception as error:  # any failure of user code means: cannot build it
        raise DynamicsError(f"{where}{name}(...) failed: {one_line(error)}") from None
    if not isinstance(module, nn.Module):
        raise DynamicsError(f"{where}{name}(...) returned {type(module).__name__}")
    if builds_in_configure_model(module):
        # Lightning builds these layers when a fit starts; offline, nothing else would.
        built_by_init = any(True for _ in module.parameters())
        try:
            module.configure_model()
        except Exception as error:
            if not built_by_init:
                raise DynamicsError(
                    f"{where}{name}.configure_model() failed: {one_line(error)}"
                ) from None
            # A configure_model that shards (FSDP2's fully_shard) needs the fit's process
            # group, and fails before changing the layers __init__ built: those are the model,
            # checked against the run's layout and loaded with θ0 by the caller.
            warnings.warn(
                f"{where}{name}.configure_model() failed ({one_line(error)}); the model is "
                "the layers its __init__ built",
                stacklevel=2,
            )
    return module


def _load_theta0(run: Run, module: nn.Module, args: Mapping[str, Any]) -> None:
    if run.layout is None:
        raise DynamicsError(f"{run.path.name}: no parameter layout recorded")
    theta0 = run.stored_states()[0]
    try:
        load_state(module, theta0.theta, run.layout, theta0.buffers, run.buffer_layout)
    except ValueError as error:
        raise DynamicsError(
            f"{run.path.name}: the rebuilt model differs from the run's ({error}); were these "
            f"its init args? {json.dumps(dict(args), default=str)}"
        ) from None


def _replay_edits(run: Run, module: nn.Module, given_model: bool) -> None:
    """Redo what the run's callbacks did to the module that θ0 does not hold: shifting."""
    for edit in run.model_edits or ():
        kind, by = edit.get("edit"), str(edit.get("class_path", "?")).rsplit(".", 1)[-1]
        if kind == names.EDIT_SHIFT:
            _replay_shift(run, module, edit)
        elif kind != names.EDIT_INIT_BIASES and not given_model:
            factory = ParameterError("model", "a factory that builds the edited model")
            raise DynamicsError(
                f"{run.path.name}: the model was edited at fit time by {by} ({kind}), which "
                f"cannot be replayed offline; pass {factory}"
            ).quoting(factory)


def _replay_shift(run: Run, module: nn.Module, edit: Mapping[str, Any]) -> None:
    """Shift ``module`` as the recorded edit did, and check every shifted activation's φ,
    shift and c against the recorded table."""
    settings = edit.get("settings") or {}
    try:
        shift_activations(
            module,
            settings.get("shift", "expected"),
            include=settings.get("include") or (),
            exclude=settings.get("exclude") or (),
            dim=settings.get("dim", -1),
        )
    except DynamicsError as error:
        raise DynamicsError(f"{run.path.name}: replaying the recorded shift: {error}") from None
    named = dict(module.named_modules(remove_duplicate=False))
    for row in edit.get("table") or ():
        if not row.get("replaced"):
            continue
        where, shifted = row["module"] or "<model>", named.get(row["module"])
        found = (
            f"{shifted.phi!r} shift={shifted.shift!r} c={shifted.constant!r}"
            if isinstance(shifted, ShiftedActivation)
            else repr(shifted)
        )
        recorded_c = row["c"] if row["c"] is not None else 0.0
        if not (
            isinstance(shifted, ShiftedActivation)
            and repr(shifted.phi) == row["activation"]
            and shifted.shift == row["shift"]
            and math.isclose(shifted.constant, recorded_c, rel_tol=1e-12, abs_tol=1e-15)
        ):
            raise DynamicsError(
                f"{run.path.name}: the recorded shift of {where} ({row['activation']} "
                f"shift={row['shift']!r} c={row['c']!r}) cannot be replayed: the rebuilt model "
                f"has {found} there"
            )


def _check_submodules(run: Run, module: nn.Module) -> None:
    """Refuse a rebuilt model whose submodules differ in class or settings from the run's."""
    differing = submodule_differences(run, module)
    if differing:
        factory = ParameterError("model", "a factory that builds it as trained")
        raise DynamicsError(
            f"{run.path.name}: the rebuilt model's submodules differ from the run's "
            f"({differing}); was the model edited after it was built (shift_activations in "
            f"the training script)? Shift it with the ShiftActivations callback, or pass {factory}"
        ).quoting(factory)


def _recorded_config(run: Run, record: Mapping[str, Any], trusted: bool) -> Any:
    """The Hugging Face config a run recorded (``module_record``'s ``hf_config``), rebuilt by
    its class's ``from_dict``; the class is trusted as a model's class is, and only a
    ``transformers`` config class is ever called."""
    path = str(record.get("class_path", ""))
    cls = _recorded_class(run, path, trusted)
    if not (inspect.isclass(cls) and is_pretrained_config(cls)):
        model = ParameterError("model", "to name the model's class or a factory")
        raise DynamicsError(
            f"{run.path.name}: recorded config {path} is not a transformers config class; "
            f"refusing to call it (pass {model})"
        ).quoting(model)
    implementation = record.get("attn_implementation")
    options = {"attn_implementation": implementation} if implementation else {}
    try:
        return cls.from_dict(dict(record.get("values") or {}), **options)
    except Exception as error:  # any failure of the library on recorded data
        raise DynamicsError(
            f"{run.path.name}: rebuilding config {cls.__qualname__} failed: {one_line(error)}"
        ) from None


def _check_module_class(run: Run, class_path: str, target: Any) -> None:
    """Refuse to call a recorded class that is not a ``torch.nn.Module`` subclass."""
    if not (inspect.isclass(target) and issubclass(target, nn.Module)):
        model = ParameterError("model", "to name the model's class")
        raise DynamicsError(
            f"{run.path.name}: recorded model {class_path} is not a torch.nn.Module subclass; "
            f"refusing to call it (pass {model})"
        ).quoting(model)


def _check_trusted(run: Run, class_path: str) -> None:
    """Refuse a recorded class path whose top-level package no installed distribution provides.

    Looked up in the installed packages' metadata: nothing is imported, so a crafted file runs
    no code (the standard library and the working directory's modules are not installed
    distributions).
    """
    parts = class_path.split(".")
    if parts[0] not in importlib.metadata.packages_distributions():
        model = ParameterError("model", f"path/to/file.py:{parts[-1]}")
        trust = ParameterError("trust_recorded_model", "if you trust this file")
        raise DynamicsError(
            f"{run.path.name}: recorded model {class_path} is outside the installed packages "
            f"(importing it would run its code); name it with {model}, or pass {trust}"
        ).quoting(model, trust)


def _recorded_class(run: Run, class_path: str, trusted: bool) -> Any:
    if not class_path:
        model = ParameterError("model", "to name its class or a factory")
        raise DynamicsError(f"{run.path.name}: no model class recorded; pass {model}").quoting(
            model
        )
    class_path = RENAMED_CLASSES.get(class_path, class_path)
    module_name, _, qualname = class_path.partition(".")
    if module_name == "__main__":
        model = ParameterError("model", f"path/to/script.py:{qualname}")
        raise DynamicsError(
            f"{run.path.name}: model {qualname} was defined in the training script (__main__), "
            f"which cannot be imported; pass {model}"
        ).quoting(model)
    if "<locals>" in class_path:
        model = ParameterError("model", "pkg.module:factory (or path/to/file.py:factory)")
        raise DynamicsError(
            f"{run.path.name}: model {class_path} was defined inside a function; pass {model}"
        ).quoting(model)
    if "__main__" in class_path.split("."):
        model = ParameterError("model", f"path/to/file.py:{qualname.split('.')[-1]}")
        raise DynamicsError(
            f"{run.path.name}: recorded model {class_path} names a __main__ module, which runs "
            f"a program when imported; pass {model}"
        ).quoting(model)
    if not trusted:
        _check_trusted(run, class_path)
    # The module path and the class's qualified name share dots: the longest importable
    # prefix is the module.
    parts = class_path.split(".")
    first_error: Exception | None = None
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            with _importable_working_directory() if trusted else contextlib.nullcontext():
                module = importlib.import_module(module_name)
        except ImportError as error:
            first_error = first_error or error
            continue
        except Exception as error:  # the user's module raised while importing
            raise DynamicsError(f"importing {module_name} failed: {one_line(error)}") from None
        return _attribute(module, ".".join(parts[cut:]), class_path)
    model = ParameterError("model", f"path/to/file.py:{parts[-1]}")
    raise DynamicsError(
        f"{run.path.name}: cannot import model {class_path} ({one_line(first_error)}); pass {model}"
    ).quoting(model)


def model_target(spec: str) -> Any:
    """The callable named by ``pkg.module:name`` or ``path/to/file.py:name`` (the ``model``
    of :func:`rebuild_module`).

    Example::

        factory = model_target("path/to/train.py:MyModule")  # imports train.py, not __main__

    Raises:
        ParameterError: (of ``model``) ``spec`` is malformed, cannot be imported, or names no
            class or function.
    """
    location, _, attribute = spec.rpartition(":")
    if not location or not attribute:
        raise ParameterError(
            "model", f"must be pkg.module:name or path/to/file.py:name, got {spec!r}"
        )
    if location.endswith(".py") or "/" in location or os.sep in location:
        module = _module_from_file(Path(location), spec)
    else:
        try:
            with _importable_working_directory():
                module = importlib.import_module(location)
        except Exception as error:
            raise ParameterError("model", f"{spec}: {one_line(error)}") from None
    target = _attribute(module, attribute, spec)
    if not callable(target):
        raise ParameterError("model", f"{spec}: {attribute} is not a class or function")
    return target


def _module_from_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise ParameterError("model", f"{spec}: no such file {path}")
    path = path.resolve()
    # Not "__main__": a script's `if __name__ == "__main__":` training stays off.
    name = f"_dynamics_model_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up while it runs
    try:
        with _importable_working_directory(path.parent):
            loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        del sys.modules[name]
        raise ParameterError(
            "model", f"{spec}: running {path.name} failed: {one_line(error)}"
        ) from None
    return module


def _attribute(module: Any, qualname: str, spec: str) -> Any:
    target = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
        if target is None:
            # The file, not the module's name: a script is imported under a private alias.
            where = getattr(module, "__file__", None) or module.__name__
            raise DynamicsError(f"{spec}: {where} has no {qualname}")
    return target


@contextlib.contextmanager
def _importable_working_directory(*folders: Path) -> Iterator[None]:
    """Modules of the working directory (and ``folders``) importable while importing, as
    ``python -c`` would make them, after the installed packages so as to shadow none."""
    added = [str(p) for p in (*folders, Path.cwd()) if str(p) not in sys.path]
    sys.path.extend(added)
    try:
        yield
    finally:
        for entry in added:
            sys.path.remove(entry)
