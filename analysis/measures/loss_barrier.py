"""The loss along straight lines between runs' parameters, and the barrier each line crosses.

For runs compared with a reference, :func:`loss_barriers` evaluates the loss at
θ(α) = (1 − α)·start + α·end for evenly spaced α in [0, 1] on three kinds of line: from the
reference's θT to each other run's θT, and from θ0 to θT of every run. A line's barrier height
is the largest loss along it minus the mean of the losses at its ends (so defined it is
never below 0, and half the ends' difference on a line that only falls); its height above the
chord, the largest L(α) − ((1 − α)·L(0) + α·L(1)), is 0 when the line never rises above the
straight line joining its ends' losses (no bump between them) and positive when it climbs over
a ridge.

The loss is the one the plane views draw
(:func:`~dynamics.analysis.measures.rebuilt_loss.rebuilt_surface`):
the model rebuilt from the run file, in eval mode, on the stored probe batch, by the loss rule
the run file keeps (:mod:`dynamics.passes.loss_rule`). A line between two runs uses the
reference's model, loss rule and probe batch, and each point the buffers (BatchNorm
statistics) of the stored state of either run nearest to it
(:mod:`dynamics.geometry.nearest_buffers`), so each end is evaluated with its own run's final
buffers; it is drawn only for runs whose recorded models agree in class, loss rule,
model edits and submodules (a shifted and an unshifted network, or one model under two loss
rules, are two loss functions: no line joins them in one). A run whose model cannot be
rebuilt, that stores no probe batch, θ0 or θT, or whose training diverged (θT not finite), gets
a one-line remark instead of its lines; the comparison goes on.

A held-out batch (:func:`load_batch`, from a file ``torch.save`` wrote) replaces the probe
batches on every line, and then no probe batch is needed; a rebuilt model that cannot take it
is an error, not a remark, since the batch is the user's input. The table names each line's
batch with its size. Its size is checked before it is loaded, from what the file declares (a
few compressed bytes can declare gigabytes), against a bound tied to the runs' probe batches.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dynamics.analysis.measures.run_comparison import NOT_RECORDED, SAME, comparability
from dynamics.errors import DynamicsError, ParameterError, one_line
from dynamics.store import Run, names
from dynamics.system import available_bytes

if TYPE_CHECKING:
    from dynamics.geometry.landscape import LossSurface
    from dynamics.model.rebuild import RunInitArgs

#: Points evaluated along each line, the ends included (α = 0, 0.05, ..., 1).
POINTS = 21
#: The most points along a line: each is a forward pass; finer shows nothing new.
MAX_POINTS = 1001
#: A held-out batch may hold this many times the bytes of the runs' largest probe batch ...
HELD_OUT_PER_PROBE_BATCH = 1024
#: ... and at least this many bytes (a run's probe batch can be a handful of samples).
HELD_OUT_MIN_BOUND = 64 * 2**20
#: The comparability checks two runs must agree in for the reference's model to be theirs.
_SAME_FUNCTION = ("module", "loss rule", "model edits", "submodules")


@dataclass(frozen=True)
class LinePath:
    """The loss along one straight line in parameter space.

    Attributes:
        name: which line, e.g. ``θT(a) → θT(b)``.
        run: the run it is drawn for (its colour): θ0 → θT's run, or the run compared with
            the reference on a line between their θT.
        between_runs: a line between two runs' θT (drawn dashed), not θ0 → θT of one.
        alphas: the interpolation coefficients, from 0 (the start) to 1 (the end).
        losses: the loss at each α.
        batch: the batch the losses are computed on, with its size: a run's probe batch (the
            model is that run's) or the held-out batch.
        buffers: which buffers the points use (empty when the model has none).
    """

    name: str
    run: str
    between_runs: bool
    alphas: np.ndarray
    losses: np.ndarray
    batch: str
    buffers: str = ""

    @property
    def barrier(self) -> float:
        """The largest loss along the line minus the mean of the losses at its ends."""
        return float(np.max(self.losses) - (self.losses[0] + self.losses[-1]) / 2)

    @property
    def above_chord(self) -> float:
        """The largest height of the loss above the straight line between its ends'
        losses, max over α of L(α) − ((1 − α)·L(0) + α·L(1)): 0 for a line that never rises
        above its chord (e.g. a monotone or convex one), where :attr:`barrier` is still
        half the ends' difference."""
        chord = (1 - self.alphas) * self.losses[0] + self.alphas * self.losses[-1]
        return float(np.max(self.losses - chord))

    @property
    def peak_alpha(self) -> float:
        """Where along the line the loss is largest."""
        return float(self.alphas[int(np.argmax(self.losses))])


@dataclass(frozen=True)
class HeldOutBatch:
    """A batch given by the user that every line is evaluated on instead of the probe batches.

    Attributes:
        batch: what the loss rule is handed: a tensor, or dicts, lists and tuples of them.
        name: what the page calls it, with its size, e.g. ``held-out batch val.pt (64 samples)``.
        path: the file it was loaded from (an input the page must not overwrite).
    """

    batch: Any
    name: str
    path: Path | None = None


@dataclass(frozen=True)
class Barriers:
    """The lines evaluated between compared runs, and why any could not be."""

    lines: list[LinePath]
    remarks: list[str]


def load_batch(
    path: str | os.PathLike, runs: Sequence[Run] = (), what: str = "barrier batch"
) -> HeldOutBatch:
    """A batch saved with ``torch.save``: a tensor, or dicts, lists and tuples of tensors (and
    numbers, strings, None), loaded to the CPU with ``weights_only=True``, so that a file
    holding any other object is refused without running its code.

    Before it is loaded, the bytes the file declares (the uncompressed sizes of its zip
    records; a file of another format cannot hold more than its length) are checked against
    :func:`held_out_bound` of ``runs``.

    Raises:
        DynamicsError: no such file, one declaring more than the bound, not a file
            ``torch.save`` wrote, one holding other objects (pickled classes, named tuples,
            sizes, devices), no tensor at all or an empty one.

    Example::

        batch = load_batch("val.pt", runs)  # a file torch.save wrote
    """
    import torch

    path = Path(path)
    where = f"{what} {path}"
    if not path.is_file():
        raise DynamicsError(f"{where}: no such file")
    declared, bound = _declared_bytes(path), held_out_bound(runs)
    if declared > bound:
        raise DynamicsError(
            f"{where}: declares {declared / 2**20:,.1f} MiB of data, more than the "
            f"{bound / 2**20:,.1f} MiB a held-out batch of these runs may hold "
            f"({HELD_OUT_PER_PROBE_BATCH}× their largest probe batch, at least "
            f"{HELD_OUT_MIN_BOUND / 2**20:.0f} MiB, at most the memory available)"
        )
    try:
        batch = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message is a page of advice; the object it refused is what the user needs.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if found is None:  # not a pickle, or one weights_only=True cannot read
            raise DynamicsError(
                f"{where}: not a file torch.save wrote of tensors in dicts, lists and tuples "
                "(torch.load with weights_only=True refused it)"
            ) from None
        raise DynamicsError(
            f"{where}: refused, it holds a pickled {found.group(1)}, not only tensors in "
            "dicts, lists and tuples (loaded with weights_only=True, which never runs a "
            "file's code)"
        ) from None
    except Exception as error:  # torch.load's errors on a damaged or foreign file vary
        raise DynamicsError(f"{where}: not a file torch.save wrote ({one_line(error)})") from None
    tensors = _batch_tensors(batch, where)
    if not tensors:
        raise DynamicsError(f"{where}: holds no tensor, so it is no batch")
    if any(t.numel() == 0 for t in tensors):
        # A mean over no samples is NaN: every line would be NaN, not a measurement.
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise DynamicsError(
            f"{where}: holds an empty tensor (shapes {shapes}); a loss over no samples is NaN"
        )
    return HeldOutBatch(batch, f"held-out batch {path.name} ({_size(tensors)})", path)


def held_out_bound(runs: Sequence[Run]) -> int:
    """The most bytes a held-out batch of ``runs`` may declare: :data:`HELD_OUT_PER_PROBE_BATCH`
    times their largest stored probe batch, at least :data:`HELD_OUT_MIN_BOUND`, and no more
    than the memory available."""
    probe = [
        sum(
            getattr(run.vector(n), "nbytes", 0)  # an unfilled vector reads as None
            for n in run.vector_names
            if n.startswith(names.PROBE_BATCH_PREFIX)
        )
        for run in runs
    ]
    tied = max(HELD_OUT_MIN_BOUND, HELD_OUT_PER_PROBE_BATCH * max(probe, default=0))
    return min(tied, available_bytes())


def _declared_bytes(path: Path) -> int:
    """What loading the file may allocate, read from it without loading: the uncompressed
    sizes its zip directory declares (``torch.save``'s format), else its length."""
    try:
        with zipfile.ZipFile(path) as archive:
            return sum(record.file_size for record in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return path.stat().st_size


def line_losses(surface, start: np.ndarray, end: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """The loss of ``surface`` (a :class:`~dynamics.geometry.landscape.LossSurface`) at
    (1 − α)·start + α·end for each α, the points formed in float64 (the ends exactly)."""
    start, end = np.asarray(start, np.float64), np.asarray(end, np.float64)
    return np.array([surface.loss((1 - alpha) * start + alpha * end) for alpha in alphas])


def check_barrier_points(barrier_points: int) -> None:
    """Refuse a number of points per loss-barrier line other than 0 (no barriers) or 2 to
    :data:`MAX_POINTS`.

    Example::

        check_barrier_points(21)  # returns; 1 or 5000 raise ParameterError
    """
    if barrier_points == 1 or not 0 <= barrier_points <= MAX_POINTS:
        raise ParameterError(
            "barrier_points", f"must be 0 or from 2 to {MAX_POINTS}, got {barrier_points}"
        )


def loss_barriers(
    runs: Sequence[Run],
    labels: Sequence[str],
    points: int = POINTS,
    *,
    model: str | None = None,
    init_args: dict | RunInitArgs | None = None,
    trust_recorded_model: bool = False,
    held_out: HeldOutBatch | None = None,
) -> Barriers:
    """The loss along θT(reference) → θT(run) for every other run, and θ0 → θT of each run.

    Args:
        runs: the runs; the first is the reference.
        labels: their names on the page.
        points: points per line, the ends included (at least 2).
        model: build each run's model with this class or factory instead of the recorded one.
        init_args: init args overriding the recorded ones for every run (a mapping), or each
            run's own, which also complete the ones it did not record
            (:class:`~dynamics.model.rebuild.RunInitArgs`).
        trust_recorded_model: import a recorded class from outside the installed packages.
        held_out: evaluate every line on this batch instead of the runs' probe batches.

    Returns:
        The lines evaluated, and a one-line remark for each run or pair that could not be.

    Raises:
        DynamicsError: ``points`` below 2, a rebuilt model cannot take ``held_out``
            (:class:`~dynamics.analysis.measures.rebuilt_loss.BatchRefused`), or a run's init args
            were neither recorded nor given (:class:`~dynamics.model.rebuild.MissingInitArgs`).

    Example::

        barriers = loss_barriers(runs, ["a", "b"], points=11)
        [(line.name, line.above_chord) for line in barriers.lines]
    """
    if points < 2:
        raise DynamicsError(f"a loss-barrier line needs at least 2 points, got {points}")
    alphas = np.linspace(0.0, 1.0, points)
    lines, remarks = [], []
    candidates = []  # (run, label) of the runs that store what a line needs
    lacking: dict[str, list[str]] = {}  # what is missing: the runs that lack it
    for run, label in zip(runs, labels):
        missing = _missing(run, need_probe_batch=held_out is None)
        if missing:
            lacking.setdefault(missing, []).append(label)
        else:
            candidates.append((run, label))
    remarks += [
        f"no loss barrier for {', '.join(who)}: no {missing} stored"
        for missing, who in lacking.items()
    ]
    if not candidates:
        return Barriers(lines, remarks)
    # Imported only now: a comparison of runs without lines to draw never loads torch.
    from dynamics.analysis.measures.rebuilt_loss import BatchRefused, rebuilt_surface
    from dynamics.model.probe_batch import probe_batch
    from dynamics.model.rebuild import MissingInitArgs, run_init_args

    init_args = run_init_args(init_args, [run.path for run in runs])

    def surface_of(run: Run, label: str, buffers_of: Sequence[Run] = ()) -> tuple[LossSurface, str]:
        """The run's rebuilt loss surface on its batch, and what the batch is."""
        if held_out is not None:
            batch, name = held_out.batch, held_out.name
        else:
            batch = probe_batch(run)
            name = f"stored probe batch of {label} ({_size(_batch_tensors(batch, label))})"
        surface = rebuilt_surface(
            run,
            model,
            init_args,
            trust_recorded_model,
            buffers_of=buffers_of,
            batch=batch,
            batch_name=f"the {name}",
        )
        return surface, name

    usable = {}  # label: run, for the runs whose own line could be evaluated
    for run, label in candidates:
        try:
            theta0, theta_final = _endpoints(run)
            surface, batch_name = surface_of(run, label)
        except MissingInitArgs as error:  # the user's input to complete: an error
            none = ParameterError("barrier_points", "0: no loss barriers")
            raise MissingInitArgs(f"{error} (or {none})").quoting(none) from None
        except DynamicsError as error:
            if held_out is not None and isinstance(error, BatchRefused):
                raise  # the user's batch: an error, not a remark
            remarks.append(f"no loss barrier for {label}: {error}")
            continue
        usable[label] = run
        lines.append(
            LinePath(
                f"θ0 → θT ({label})",
                label,
                False,
                alphas,
                line_losses(surface, theta0, theta_final, alphas),
                batch_name,
                surface.buffer_note,
            )
        )
    reference, first = runs[0], labels[0]
    if first not in usable:
        return Barriers(lines, remarks)
    for run, label in zip(runs[1:], labels[1:]):
        if label not in usable:
            continue
        if run.layout != reference.layout:
            remarks.append(f"no θT line {first} → {label}: their parameter layouts differ")
            continue
        differs = _other_function(reference, run, (first, label))
        if differs:
            remarks.append(f"no θT line {first} → {label}: {differs}")
            continue
        try:
            surface, batch_name = surface_of(reference, first, buffers_of=[reference, run])
        except DynamicsError as error:
            if held_out is not None and isinstance(error, BatchRefused):
                raise
            remarks.append(f"no θT line {first} → {label}: {error}")
            continue
        start, end = (_endpoints(r)[1] for r in (reference, run))
        lines.append(
            LinePath(
                f"θT({first}) → θT({label})",
                label,
                True,
                alphas,
                line_losses(surface, start, end, alphas),
                batch_name,
                surface.buffer_note,
            )
        )
    return Barriers(lines, remarks)


def _other_function(reference: Run, run: Run, labels: tuple[str, str]) -> str:
    """Why the reference's model is not a model of ``run`` (another class, another edit such
    as a shift, other submodules), in one line; empty when nothing recorded says so. Init
    args may differ (a learning rate): the line is drawn in the reference's model."""
    for check in comparability(reference, run, labels):
        if check.name in _SAME_FUNCTION and check.status not in (SAME, NOT_RECORDED):
            return (
                f"their models differ in {check.name} ({check.details}), so no one loss "
                "function holds both ends"
            )
    return ""


def _missing(run: Run, need_probe_batch: bool = True) -> str:
    """What a run lacks for its lines, read from its file without torch; empty: nothing."""
    stored = set(run.vector_names)
    if not {names.THETA0, names.THETA_FINAL} <= stored:
        return "θ0 or θT (ParameterDisplacement records them)"
    if need_probe_batch and not any(n.startswith(names.PROBE_BATCH_PREFIX) for n in stored):
        return "probe batch (GradientPlane records it)"
    return ""


def _batch_tensors(batch: Any, where: str) -> list:
    """The tensors of a batch of tensors in dicts, lists and tuples (numbers, strings and None
    beside them), depth first.

    Raises:
        DynamicsError: it holds another object.
    """
    import torch

    if isinstance(batch, torch.Tensor):
        return [batch]
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return []
    if isinstance(batch, Mapping):
        children = list(batch.values())
    elif isinstance(batch, (list, tuple)):  # named tuples of a stored probe batch too
        children = list(batch)
    else:
        kind = f"{type(batch).__module__}.{type(batch).__qualname__}"
        raise DynamicsError(f"{where}: holds a {kind}, not only tensors in dicts, lists and tuples")
    return [tensor for child in children for tensor in _batch_tensors(child, where)]


def _size(tensors: list) -> str:
    """A batch's size: the leading dimension its tensors share, else their shapes."""
    leading = {tuple(t.shape[:1]) for t in tensors}
    if len(leading) == 1 and leading != {()}:
        ((samples,),) = leading
        return f"{samples} sample{'s' if samples != 1 else ''}"
    return "tensors of shapes " + ", ".join(str(tuple(t.shape)) for t in tensors)


def _endpoints(run: Run) -> tuple[np.ndarray, np.ndarray]:
    theta0, theta_final = run.vector(names.THETA0), run.vector(names.THETA_FINAL)
    if theta0 is None or theta_final is None:
        raise DynamicsError(
            f"{run.path.name} stores no θ0 or θT (ParameterDisplacement records them)"
        )
    if not np.isfinite(theta_final).all():  # what a diverged training left: no line ends there
        raise DynamicsError(
            f"{run.path.name} diverged at step {run.diverged_at}: its θT is not finite"
        )
    return theta0, theta_final
