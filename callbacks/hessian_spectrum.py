"""Top Hessian eigenvalues during training, with extra measurements on the same operator."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection

from dynamics import world
from dynamics.callbacks.fit import Fit
from dynamics.callbacks.hessian_blocks import BlockHessian, Blocks
from dynamics.callbacks.hessian_density import HessianDensity
from dynamics.callbacks.hessian_eigenspace_overlap import EigenspaceOverlap
from dynamics.callbacks.hessian_gradient_share import GradientShare
from dynamics.callbacks.hessian_measurement import HessianMeasurement, SpectrumRow
from dynamics.callbacks.hessian_trace import HessianTrace
from dynamics.callbacks.hessian_vectors import EigenvectorSnapshots
from dynamics.callbacks.probe import Probe, Rows, SeriesSpec
from dynamics.callbacks.probe_loss import ProbeLoss, frozen_parameters, uncompiled, upcast
from dynamics.curvature import (
    Eigenpairs,
    HessianOperator,
    HessianProblem,
    Solver,
    eigenvalue_error_bounds,
    solver,
)
from dynamics.curvature.mean_operator import MeanHessianOperator
from dynamics.curvature.subspace_tracking import GUARDS
from dynamics.errors import ParameterError
from dynamics.passes.isolation import Mode, side_effect_free
from dynamics.passes.loss_rule import loss_at
from dynamics.store import View, names
from dynamics.store.views import standard_view

# Series that may hold NaN by design: no known gap below the last pair (or an unresolved one)
# for an error bound. Measurements name their own (HessianMeasurement.may_be_nan).
MAY_BE_NAN = (names.HESSIAN_ERROR_BOUNDS,)


class HessianSpectrum(Probe):
    """The top-k Hessian eigenvalues of the training loss on a fixed probe batch, or on a probe
    set of N batches (group ``hessian``), and any ``measurements`` on the same operator (trace,
    density, gradient share, eigenspace overlap, stored eigenvectors).

    With ``batches=[b1, ..., bN]`` the loss is the mean of the batches' losses (each batch
    weighs 1/N; :class:`~dynamics.curvature.mean_operator.MeanHessianOperator`), every product
    and so every measurement is over the set, and each row also stores the curvature of each
    batch along the set's top eigenvector (``batch_rayleigh``, ``batch_rayleigh_std``).

    The loss comes from the module's own loss rule, measured with the module in ``mode``,
    autocast off and the parameters in float32 (float64 for a float64 model), inside
    :func:`~dynamics.passes.isolation.side_effect_free`; under DDP every product is averaged across
    ranks. Under FSDP each row is measured on a copy holding the parameters whole on every
    rank (:meth:`ProbeLoss.whole <dynamics.callbacks.probe_loss.ProbeLoss.whole>`), with the
    rank's own probe batch and products averaged as under DDP; the warm-start vectors stay whole
    on every rank, so any rank's checkpoint holds them. What each series means, the solvers'
    accuracy, cost, peak memory and pitfalls: ``docs/probes/hessian_spectrum.md``.

    Example::

        probe = HessianSpectrum(k=5, every_n_steps=50, measurements=[HessianTrace(hvp=60)])
        DynamicsRecorder("run.h5", probes=[probe])
        # over a probe set of 8 batches (of a loader that does not shuffle)
        HessianSpectrum(k=5, batches=list(itertools.islice(probe_loader, 8)))

    Args:
        k: how many eigenvalues.
        every_n_steps: recording period in optimizer steps.
        tol: relative residual tolerance of each eigenpair.
        max_hvp: product budget of the eigensolver per row.
        batch: the probe batch; default: a copy of the fit's first training batch.
        batches: a probe set instead: a list of at least two batches (exclusive with
            ``batch``), copied, checkpointed and restored as the probe batch is.
        keep_graphs: with ``batches``, hold every batch's gradient graph for the row (N× the
            activation memory of one batch; default) or rebuild each at every product (one
            batch's memory, N forward and backward passes more per product; ``mode="eval"``
            only, as a rebuilt train-mode graph would draw another dropout mask).
        warm_start: pass each row's solver the previous row's eigenvectors (kept in
            checkpoints, so a resumed fit's rows equal an uninterrupted one's).
        seed: seed of the random start vectors (the global RNG is never used).
        mode: ``"eval"`` or ``"train"``, the :data:`~dynamics.passes.isolation.Mode` of the module
            while its Hessian is measured.
        solver: a name of :data:`~dynamics.curvature.solvers.SOLVERS` that reports residuals:
            ``"lanczos"`` (default), ``"tracking"`` or ``"power"``.
        max_basis: the most basis vectors the solver holds (tracking: before its cold restart;
            at least ``k + 2``); None: the solver's default.
        cold_every: every ``cold_every``-th record (steps that are multiples of
            ``cold_every·every_n_steps``) starts without the previous eigenvectors; 0: never.
        measurements: the extras, each a :class:`HessianMeasurement`.
        blocks: also measure the diagonal Hessian blocks, ``"layers"``, ``"groups"`` or
            ``{name: [glob, ...]}``, with the probe's ``k``: the shorthand of
            ``measurements=[BlockHessian(blocks)]`` (:class:`~dynamics.callbacks.BlockHessian`).
        **shorthands: the old spellings, accepted for this release with a warning:
            ``trace_hvp``, ``gradient_share``, ``density_runs``, ``density_steps``,
            ``eigenspace_overlap``, ``vector_budget_mb`` (each the measurement of that name).
    """

    name = names.HESSIAN

    def __init__(
        self,
        k: int = 5,
        every_n_steps: int = 50,
        tol: float = 1e-4,
        *,
        max_hvp: int = 500,
        batch: Any = None,
        batches: Sequence[Any] | None = None,
        keep_graphs: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        mode: Mode = "eval",
        solver: str = "lanczos",
        max_basis: int | None = None,
        cold_every: int = 0,
        measurements: Sequence[HessianMeasurement] = (),
        blocks: Blocks | None = None,
        **shorthands: Any,
    ) -> None:
        super().__init__(every_n_steps)
        self._solver = _certified_solver(solver)
        if max_basis is not None and max_basis < k + GUARDS:
            raise ValueError(f"max_basis must be at least k + {GUARDS}, got {max_basis}")
        if cold_every < 0:
            raise ValueError(f"cold_every must be >= 0, got {cold_every}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.tol = tol
        self.max_hvp = max_hvp
        self.warm_start = warm_start
        self.seed = seed
        self.solver = solver
        self.max_basis = max_basis
        self.cold_every = cold_every
        self.measurements = [*_from_shorthands(shorthands), *measurements]
        if blocks is not None:  # the shorthand of measurements=[BlockHessian(blocks)]
            self.measurements.append(BlockHessian(blocks))
        kinds = [type(m) for m in self.measurements]
        for measurement in self.measurements:
            if not isinstance(measurement, HessianMeasurement):
                raise ParameterError(
                    "measurements", f"must hold HessianMeasurement objects, got {measurement!r}"
                )
            if kinds.count(type(measurement)) > 1:  # their series (and state) would collide
                raise ParameterError(
                    "measurements", f"hold {type(measurement).__name__} more than once"
                )
        self.size = 0  # trainable parameters, known at setup
        self._loss = ProbeLoss("HessianSpectrum", mode, batch, batches)
        if not keep_graphs and self._loss.mode == "train":
            raise ParameterError(
                "keep_graphs",
                "False needs mode='eval': a train-mode graph rebuilt at each product draws "
                "another dropout mask",
            )
        self.keep_graphs = keep_graphs
        self.dtype: torch.dtype | None = None  # of the measurement, decided at setup
        self._ritz: torch.Tensor | None = None  # the previous row's vectors (and guards)
        self._rows: Rows = {}  # measured before the step's forward, returned after it

    @property
    def mode(self) -> Mode:
        return self._loss.mode

    def setup(self, fit: Fit, pl_module: pl.LightningModule, batch: Any) -> None:
        self._loss.setup(fit, pl_module, batch)
        # The unsharded size: under FSDP the rank's own parameters are pieces of θ.
        layout = self._loss.shards.layout
        if not layout.names:
            raise ValueError("HessianSpectrum found no trainable parameter")
        dtypes = {p.dtype for p in pl_module.parameters() if p.requires_grad}
        self.dtype = torch.float64 if dtypes == {torch.float64} else torch.float32
        self.size = layout.size
        for measurement in self.measurements:
            measurement.setup(self, fit, pl_module)

    @property
    def vector_period(self) -> int:
        """Steps between stored eigenvectors (0: none stored)."""
        snapshots = [m for m in self.measurements if isinstance(m, EigenvectorSnapshots)]
        return snapshots[0].period if snapshots else 0

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        columns = tuple(f"lambda_{i + 1}" for i in range(self.k))

        def view(series: str) -> View | None:
            return standard_view(names.HESSIAN, series)

        eigenvalues, residuals = view(names.HESSIAN_EIGENVALUES), view(names.HESSIAN_RESIDUALS)
        groups: dict[str, dict[str, SeriesSpec]] = {
            self.name: {
                names.HESSIAN_EIGENVALUES: SeriesSpec((self.k,), columns=columns, view=eigenvalues),
                names.HESSIAN_RESIDUALS: SeriesSpec((self.k,), columns=columns, view=residuals),
                names.HESSIAN_ERROR_BOUNDS: SeriesSpec((self.k,), columns=columns),
                names.HESSIAN_CONVERGED: SeriesSpec(dtype="int8"),
                names.HESSIAN_N_HVP: SeriesSpec(dtype="int32", view=view(names.HESSIAN_N_HVP)),
                names.HESSIAN_LOSS: SeriesSpec(view=view(names.HESSIAN_LOSS)),
            }
        }
        n = self._loss.set_size
        if n is not None:
            batches = tuple(f"batch_{i + 1}" for i in range(n))
            groups[self.name] |= {
                names.HESSIAN_BATCH_RAYLEIGH: SeriesSpec(
                    (n,), columns=batches, view=view(names.HESSIAN_BATCH_RAYLEIGH)
                ),
                names.HESSIAN_BATCH_RAYLEIGH_STD: SeriesSpec(
                    view=view(names.HESSIAN_BATCH_RAYLEIGH_STD)
                ),
            }
        for measurement in self.measurements:
            for group, specs in measurement.series(self.k, self.size).items():
                groups.setdefault(group, {}).update(specs)
        return groups

    def vectors(self) -> dict[str, SeriesSpec]:
        return {names.float_bits(self.name): SeriesSpec((1,), dtype="int8")}

    def initial_vectors(self) -> dict[str, np.ndarray]:
        if self.dtype is None:
            return {}
        return {names.float_bits(self.name): np.array([torch.finfo(self.dtype).bits], np.int8)}

    def settings(self) -> dict[str, Any]:
        # The solver decides how a row was measured (tracking rows may miss a new sharp
        # direction a cold Lanczos would find), so a reader of the file must see it.
        solver = {"solver": self.solver, "tol": self.tol, "cold_every": self.cold_every}
        # The set is not stored in the run file: offline tools rebuild GradientPlane's batch.
        graphs = {} if self._loss.set_size is None else {"keep_graphs": self.keep_graphs}
        return {**self._loss.settings(), **solver, **graphs}

    def on_step_start(self, fit: Fit, pl_module: pl.LightningModule, batch: Any, step: int) -> None:
        # Measured here, before the step's forward, so the row describes θ_step (the contract).
        self._rows = {}
        row = self.measure(pl_module, step)  # the measurements' own groups land in self._rows
        self._rows = {self.name: row, **self._rows}

    def on_step_end(
        self,
        fit: Fit,
        pl_module: pl.LightningModule,
        batch: Any,
        outputs: Any,
        step: int,
    ) -> Rows:
        rows, self._rows = self._rows, {}
        return rows

    def measure(self, pl_module: pl.LightningModule, step: int) -> dict[str, Any]:
        """The ``hessian`` row for the module's current parameters (rows of the measurements'
        own groups wait for :meth:`on_step_end`).

        Raises:
            FloatingPointError: if the loss, a product or a value of the row is NaN or infinite.
        """
        # Under FSDP every rank holds the parameters whole while the row is measured (double
        # backward through FSDP fails); from there on all is as under DDP: the rank's own
        # probe batch, every product averaged over the ranks.
        with self._loss.whole(pl_module) as module:
            rows = self._rows_at(module, step)
        row = rows.pop(self.name)
        may_be_nan = MAY_BE_NAN + tuple(n for m in self.measurements for n in m.may_be_nan)
        not_finite = [
            name
            for name, value in row.items()
            if name not in may_be_nan and not np.isfinite(value).all()
        ]
        if not_finite:
            raise FloatingPointError(
                f"HessianSpectrum at step {step}: {', '.join(not_finite)} not finite"
            )
        self._rows.update(rows)
        return row

    def _rows_at(self, module: torch.nn.Module, step: int) -> dict[str, dict[str, Any]]:
        """Every group's row, measured on ``module`` (holding the parameters whole)."""
        batches = self._loss.batches
        params = dict(module.named_parameters())
        varied = [n for n, p in params.items() if p.requires_grad]
        leaves = {n: params[n].detach().to(self.dtype).requires_grad_() for n in varied}
        tensors = dict(leaves)
        if any(p.dtype != self.dtype for p in params.values()):
            # Lower-precision weights (bf16/fp16 "true" precision) are upcast for the pass; the
            # frozen parameters, the buffers and the batch follow so that every op runs in
            # float32.
            tensors |= frozen_parameters(module, self.dtype, varied)
            tensors |= {n: upcast(b, self.dtype) for n, b in module.named_buffers()}
            batches = apply_to_collection(batches, torch.Tensor, upcast, self.dtype)
        averaged = world.is_distributed()
        with (
            side_effect_free(module, self.mode),
            torch.autocast(params[varied[0]].device.type, enabled=False),
            uncompiled(),  # a compiled graph supports no double backward
        ):
            loss_fns = [
                functools.partial(loss_at, module, tensors, batch, self._loss.rule)
                for batch in batches
            ]
            operator: HessianOperator | MeanHessianOperator
            if self._loss.set_size is None:
                operator = HessianOperator(
                    loss_fns[0], list(leaves.values()), average_across_ranks=averaged
                )
            else:
                operator = MeanHessianOperator(
                    loss_fns,
                    list(leaves.values()),
                    average_across_ranks=averaged,
                    keep_graphs=self.keep_graphs,
                )
            # The solvers that take the loss itself (PyHessian) are refused at construction.
            problem = HessianProblem(
                loss_fns[0], operator.params, average_across_ranks=averaged, operator=operator
            )
            return self._rows_of(problem, step)

    def _rows_of(self, problem: HessianProblem, step: int) -> dict[str, dict[str, Any]]:
        operator = problem.operator
        previous = None if self._ritz is None else self._ritz[: self.k]
        pairs = self._eigenpairs(problem, step)
        self._ritz = pairs.eigenvectors
        # From all the pairs the solver returns: a tracking solve's guards give the k-th a gap.
        bounds = eigenvalue_error_bounds(pairs.eigenvalues, pairs.residuals)
        rows: dict[str, dict[str, Any]] = {
            self.name: {
                names.HESSIAN_LOSS: operator.loss,
                names.HESSIAN_EIGENVALUES: pairs.eigenvalues[: self.k].float().numpy(),
                names.HESSIAN_RESIDUALS: pairs.residuals[: self.k].float().numpy(),
                names.HESSIAN_ERROR_BOUNDS: bounds[: self.k].float().numpy(),
                names.HESSIAN_CONVERGED: np.int8(pairs.converged),
            }
        }
        row = SpectrumRow(operator, pairs.top(self.k), previous, step, self.seed)
        for measurement in self.measurements:
            for group, values in measurement.measure(row).items():
                rows.setdefault(group, {}).update(values)
        if isinstance(operator, MeanHessianOperator):
            rows[self.name] |= batch_spread(operator, pairs.eigenvectors[0])
        rows[self.name][names.HESSIAN_N_HVP] = operator.n_hvp  # the row's products, all of them
        return rows

    def _eigenpairs(self, problem: HessianProblem, step: int) -> Eigenpairs:
        """The top k pairs (tracking: and the guards, to be tracked at the next row)."""
        entry = self._solver
        cold_due = self.cold_every and step % (self.cold_every * self.every_n_steps) == 0
        warm = self.warm_start and entry.uses_previous and not cold_due
        return entry.solve(
            problem,
            self.k,
            self.tol,
            max_hvp=self.max_hvp,
            previous=self._ritz if warm else None,
            basis_size=self.max_basis if entry.uses_basis else None,
            seed=self.seed,
        )

    def teardown(self) -> None:
        self._ritz = None
        self._rows = {}
        for measurement in self.measurements:
            measurement.teardown()

    def state_dict(self) -> dict[str, Any]:
        # The warm-start vectors too: a resumed fit starts its next row's solve where an
        # uninterrupted one would, so its rows are the same. The measurements' state (θ of the
        # eigenspace overlap) sits beside it under their own keys, as in files before them.
        ritz = {} if self._ritz is None else {"ritz": self._ritz.cpu()}
        state = {**self._loss.state_dict(), **ritz}
        for measurement in self.measurements:
            state |= measurement.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loss.load_state_dict(state)
        self._ritz = state.get("ritz")
        for measurement in self.measurements:
            measurement.load_state_dict(state)


def batch_spread(operator: MeanHessianOperator, vector: torch.Tensor) -> dict[str, Any]:
    """The Rayleigh quotients ``vᵀ H_i v / vᵀv`` of each batch's Hessian along ``vector`` (the
    set's top eigenvector) and their sample standard deviation: N single-batch products, the
    cost of one product of the set. Their mean is the set's ``vᵀ H v / vᵀv`` (λ1 once
    converged); their spread is how far one batch's curvature along v1 strays from it."""
    vector = vector.to(device=operator.device, dtype=operator.dtype)
    norm = torch.dot(vector, vector)
    quotients = torch.stack(
        [
            torch.dot(vector, operator.batch_matvec(i, vector)) / norm
            for i in range(operator.n_batches)
        ]
    )
    return {
        names.HESSIAN_BATCH_RAYLEIGH: quotients.cpu().numpy(),
        names.HESSIAN_BATCH_RAYLEIGH_STD: float(quotients.std(correction=1)),
    }


def _certified_solver(name: str) -> Solver:
    """The solver table's entry ``name``, if its rows can be stored (residuals are a series)."""
    entry = solver(name)
    if not entry.certified:
        raise ParameterError(
            "solver",
            f"{name!r} reports no residuals, which every row stores; use it through "
            "dynamics.curvature.top",
        )
    return entry


#: The old keyword spellings of the measurements, in the order their series were declared.
_SHORTHANDS = (
    "trace_hvp",
    "gradient_share",
    "density_runs",
    "density_steps",
    "eigenspace_overlap",
    "vector_budget_mb",
)


def _from_shorthands(shorthands: dict[str, Any]) -> list[HessianMeasurement]:
    """The measurements the old keywords ask for (each accepted for this release, with a
    warning naming the new spelling)."""
    unknown = sorted(set(shorthands) - set(_SHORTHANDS))
    if unknown:
        raise TypeError(f"HessianSpectrum got an unexpected keyword argument {unknown[0]!r}")
    if not shorthands:
        return []
    warnings.warn(
        f"HessianSpectrum({', '.join(shorthands)}=...) is now measurements=[...] "
        "(HessianTrace, GradientShare, HessianDensity, EigenspaceOverlap, EigenvectorSnapshots); "
        "the keywords go in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    made: list[HessianMeasurement] = []
    try:
        if shorthands.get("trace_hvp"):
            made.append(HessianTrace(shorthands["trace_hvp"]))
        if shorthands.get("gradient_share"):
            made.append(GradientShare())
        if shorthands.get("density_runs"):
            made.append(
                HessianDensity(shorthands["density_runs"], shorthands.get("density_steps", 40))
            )
        if shorthands.get("eigenspace_overlap"):
            made.append(EigenspaceOverlap())
        if shorthands.get("vector_budget_mb", 0) > 0:
            made.append(EigenvectorSnapshots(shorthands["vector_budget_mb"]))
    except ParameterError as error:
        old = {"hvp": "trace_hvp", "runs": "density_runs", "steps": "density_steps"}
        raise ParameterError(old.get(error.parameter, error.parameter), error.problem) from None
    return made
