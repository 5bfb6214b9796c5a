"""Top Hessian eigenvalues (and optionally trace, gradient share, density) during training."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection

from dynamics import world
from dynamics.callbacks.probe import Probe, Rows, SeriesSpec, expected_steps
from dynamics.callbacks.probe_loss import ProbeLoss, frozen_parameters, uncompiled, upcast
from dynamics.curvature import (
    Eigenpairs,
    HessianOperator,
    eigenvalue_error_bounds,
    hutch_plus_plus,
    lanczos,
    spectral_density,
    track_eigenpairs,
)
from dynamics.geometry.subspace_overlap import subspace_overlap, update_share
from dynamics.params.vectors import flatten
from dynamics.passes.isolation import Mode, side_effect_free
from dynamics.passes.loss_rule import loss_at
from dynamics.store import View, names
from dynamics.store.views import standard_view

# Eigenvectors beyond the top k that the tracking solver carries along: without them the k-th
# pair of a cluster converges at the rate of its gap to the (k+1)-th eigenvalue, which on the
# teacher–student model left most records to the cold restart.
GUARDS = 2

# Series that may hold NaN by design: no previous record on a fit's first row, no known gap
# below the last pair (or an unresolved one) for an error bound.
MAY_BE_NAN = (names.HESSIAN_OVERLAP, names.HESSIAN_UPDATE_SHARE, names.HESSIAN_ERROR_BOUNDS)


class HessianSpectrum(Probe):
    """The top-k Hessian eigenvalues of the training loss on a fixed probe batch.

    At every due step the loss of the module on the probe batch — by the loss rule of
    :mod:`dynamics.passes.loss_rule`, so any LightningModule works unchanged — is differentiated
    twice
    and its top-k eigenvalues found by thick-restart Lanczos (:func:`dynamics.curvature.lanczos`),
    started from the previous recorded step's eigenvectors. All of it runs inside
    :func:`~dynamics.passes.isolation.side_effect_free` with the module in ``mode``, autocast off
    and
    the parameters in float32 (float64 if the model is float64), whatever the training
    precision; the vector ``hessian_float_bits`` in the run file states which, and the probe's
    settings in the file's ``probes`` attribute state the mode and where the loss came from.
    Attention runs on the math backend of ``F.scaled_dot_product_attention``, the only one that
    can be differentiated twice (:func:`~dynamics.curvature.operator.twice_differentiable`).

    In the default ``mode="eval"`` dropout is off and BatchNorm uses its running statistics, so
    the spectrum is a deterministic function of θ; ``mode="train"`` measures the loss as the
    training step sees it (one dropout mask and one set of batch statistics per row).

    ``solver="tracking"`` refines the previous row's eigenvectors instead
    (:func:`dynamics.curvature.track_eigenpairs`: block Rayleigh–Ritz with residual expansion,
    a cold Lanczos when the subspace was lost); its residual test is the same ``‖H v − λ v‖ ≤
    tol·|λ|``, so each row's ``residuals`` bound the error as for Lanczos. With a loose ``tol``
    (``1e-2``) it is the cheap mode for long runs: the eigenvalue error of a Ritz value is of
    order ``‖r‖²/gap``, far below ``‖r‖`` — within 1e-3 of a tight cold Lanczos at every record
    of ``benchmarks/bench_hessian.py`` — but only ``‖r‖`` itself is guaranteed, and pairs are
    certified as eigenpairs, not as the top k (a new sharp direction orthogonal to the tracked
    ones would be missed until a cold restart). The default stays ``"lanczos"``, which
    finds the top k from a random component too.

    Under DDP every rank differentiates the loss on its own probe batch and every product is
    averaged across ranks: the eigenvalues are those of the data-parallel Hessian, identical on
    all ranks (only rank zero writes).

    When the probe cannot measure, it raises rather than record a wrong number, and the
    recorder disables it and records why: :class:`~dynamics.callbacks.ProbeUnavailable` at
    setup for a manually optimized module without ``dynamics_loss`` (its training step would
    step the optimizer), and :class:`FloatingPointError` from a due step whose loss, products
    or results are NaN or infinite (a row of NaN would read as data).

    Series (group ``hessian``), one row per due step:

    - ``eigenvalues``, ``residuals`` (k): largest first, and ``‖H v − λ v‖`` of each;
    - ``error_bounds`` (k): ``‖r‖²/δ``, the Kato–Temple bound on each eigenvalue's error, with
      ``δ`` its gap to the other pairs' values less their residuals
      (:func:`dynamics.curvature.eigenvalue_error_bounds`: it holds when the pairs are the top
      ones, each within its residual of its eigenvalue); NaN where no gap is known — the k-th
      with the Lanczos solver (no pair below it), or a gap the residuals do not resolve;
    - ``converged``: 1 when every residual met ``tol`` within ``max_hvp`` products;
    - ``n_hvp``: Hessian-vector products the row cost (eigenvalues, trace and density);
    - ``loss``: the probe-batch loss;
    - ``trace``, ``trace_stderr`` (with ``trace_hvp``): Hutch++ estimate and its error;
    - ``gradient_share`` (with ``gradient_share=True``): ``‖P_k g‖² / ‖g‖²`` for the probe-batch
      gradient ``g`` and the projector ``P_k`` on the top-k eigenvectors;
    - ``density_nodes``, ``density_weights`` (runs, steps) (with ``density_runs``): the
      stochastic Lanczos quadrature; :func:`dynamics.curvature.broadened_density` turns it into
      a density on any grid;
    - ``overlap_previous`` and ``update_share`` (with ``eigenspace_overlap=True``): how fast the
      sharp directions rotate, ``‖V_sᵀ V_t‖²_F / k`` for the top-k eigenvectors ``V_s`` of the
      previous row (step ``s``) and ``V_t`` of this one, and how much of the update between the
      two rows moved along them, ``‖V_s (θt − θs)‖² / ‖θt − θs‖²``; NaN on a fit's first row
      (no previous record). Costs one more parameter vector of memory. When λ_k equals
      λ_{k+1} (a repeated eigenvalue, e.g. a linear layer with several outputs under MSE) the
      top-k eigenspace is not one subspace and its overlap means nothing.

    Group ``hessian_vectors`` (with ``vector_budget_mb``): the top-k eigenvectors ``vectors``
    ``(k, n)`` in float32 (the order of the trainable parameters), at records thinned evenly
    so that the fit's expected total stays within the budget, as parameter snapshots are; the
    first record is always among them. ``dynamics compare`` draws the overlap of two runs'
    eigenspaces at the steps both stored (:mod:`dynamics.analysis.eigenspace_overlap`).

    Args:
        k: how many eigenvalues.
        every_n_steps: recording period in optimizer steps.
        tol: relative residual tolerance of each eigenpair.
        max_hvp: product budget of the eigensolver per row.
        trace_hvp: products spent on the Hutch++ trace per row (0: no trace).
        gradient_share: record the share of the gradient in the top-k eigenspace.
        density_runs: stochastic Lanczos quadrature runs per row (0: no density).
        density_steps: Lanczos steps per quadrature run.
        batch: the probe batch; default: a copy of the fit's first training batch.
        warm_start: start each row's Lanczos from the previous row's eigenvectors (kept in
            checkpoints, so a resumed fit's rows equal an uninterrupted one's).
        seed: seed of the random start vectors (the global RNG is never used).
        mode: ``"eval"`` or ``"train"``, the :data:`~dynamics.passes.isolation.Mode` of the module
            while its Hessian is measured.
        eigenspace_overlap: record ``overlap_previous`` and ``update_share``.
        vector_budget_mb: bytes (MiB) for stored eigenvectors over the fit; 0 stores none.
        solver: ``"lanczos"`` (thick-restart Lanczos, warm-started when ``warm_start``) or
            ``"tracking"`` (refine the previous row's eigenvectors; the first row, and any row
            whose subspace was lost, is a cold Lanczos).
        max_basis: with ``solver="tracking"``, basis vectors before the cold restart
            (default ``5·(k + 2)``: the k pairs and two guards, as in
            :func:`~dynamics.curvature.track_eigenpairs`).
        cold_every: with ``solver="tracking"``, a cold Lanczos (random start) at every
            ``cold_every``-th record (steps that are multiples of ``cold_every·every_n_steps``),
            the safeguard against a new sharp direction orthogonal to the tracked ones, which
            no residual test can see; 0: only the first record and lost subspaces are cold.
    """

    name = names.HESSIAN

    def __init__(
        self,
        k: int = 5,
        every_n_steps: int = 50,
        tol: float = 1e-4,
        *,
        max_hvp: int = 500,
        trace_hvp: int = 0,
        gradient_share: bool = False,
        density_runs: int = 0,
        density_steps: int = 40,
        batch: Any = None,
        warm_start: bool = True,
        seed: int = 0,
        mode: Mode = "eval",
        solver: Literal["lanczos", "tracking"] = "lanczos",
        max_basis: int | None = None,
        cold_every: int = 0,
        eigenspace_overlap: bool = False,
        vector_budget_mb: float = 0.0,
    ) -> None:
        super().__init__(every_n_steps)
        if solver not in ("lanczos", "tracking"):
            raise ValueError(f"solver must be 'lanczos' or 'tracking', got {solver!r}")
        if max_basis is not None and max_basis < k + GUARDS:
            raise ValueError(f"max_basis must be at least k + {GUARDS}, got {max_basis}")
        if cold_every < 0:
            raise ValueError(f"cold_every must be >= 0, got {cold_every}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if trace_hvp and trace_hvp < 4:
            raise ValueError(f"trace_hvp must be 0 or at least 4, got {trace_hvp}")
        if density_runs < 0 or density_steps < 1:
            raise ValueError("density_runs must be >= 0 and density_steps >= 1")
        self.k = k
        self.tol = tol
        self.max_hvp = max_hvp
        self.trace_hvp = trace_hvp
        self.gradient_share = gradient_share
        self.density_runs = density_runs
        self.density_steps = density_steps
        self.warm_start = warm_start
        self.seed = seed
        self.solver = solver
        self.max_basis = max_basis
        self.cold_every = cold_every
        self.eigenspace_overlap = eigenspace_overlap
        self.vector_budget_mb = vector_budget_mb
        self.vector_period = 0  # steps between stored eigenvectors; 0: none
        self._size = 0  # trainable parameters, known at setup
        self._theta: torch.Tensor | None = None  # θ at the previous row (eigenspace_overlap)
        self._loss = ProbeLoss("HessianSpectrum", mode, batch)
        self._names: list[str] = []  # the trainable parameters, found at setup
        self.dtype: torch.dtype | None = None  # of the measurement, decided at setup
        self._ritz: torch.Tensor | None = None
        self._row: dict[str, Any] | None = None

    @property
    def mode(self) -> Mode:
        return self._loss.mode

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self._loss.setup(trainer, pl_module, batch)
        self._names = [n for n, p in pl_module.named_parameters() if p.requires_grad]
        if not self._names:
            raise ValueError("HessianSpectrum found no trainable parameter")
        dtypes = {p.dtype for p in pl_module.parameters() if p.requires_grad}
        self.dtype = torch.float64 if dtypes == {torch.float64} else torch.float32
        self._size = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        self.vector_period, reason = self._vector_plan(expected_steps(trainer, pl_module))
        if reason:
            self.note(getattr(trainer, "global_step", 0), f"{reason}: no eigenvectors stored")

    def _vector_plan(self, steps: float) -> tuple[int, str]:
        """Steps between stored eigenvectors (0: none) and, when none fit, why."""
        if self.vector_budget_mb <= 0:
            return 0, ""
        each = 4 * self.k * self._size
        capacity = int(self.vector_budget_mb * 2**20 // each)
        if capacity < 2:
            return 0, (
                f"vector_budget_mb={self.vector_budget_mb:g} holds fewer than 2 records of "
                f"{self.k} eigenvectors of {self._size:,} parameters ({each / 2**20:.1f} MiB each)"
            )
        if not 0 < steps < math.inf:  # Lightning answers -1 for an unknown length
            return 0, "the run's length is unknown, so stored eigenvectors cannot be spread over it"
        records = (int(steps) - 1) // self.every_n_steps + 1
        # capacity - 1 intervals between capacity records, the first at step 0.
        return self.every_n_steps * max(1, math.ceil((records - 1) / (capacity - 1))), ""

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        columns = tuple(f"lambda_{i + 1}" for i in range(self.k))

        def view(series: str) -> View | None:
            return standard_view(names.HESSIAN, series)

        eigenvalues, residuals = view(names.HESSIAN_EIGENVALUES), view(names.HESSIAN_RESIDUALS)
        specs = {
            names.HESSIAN_EIGENVALUES: SeriesSpec((self.k,), columns=columns, view=eigenvalues),
            names.HESSIAN_RESIDUALS: SeriesSpec((self.k,), columns=columns, view=residuals),
            names.HESSIAN_ERROR_BOUNDS: SeriesSpec((self.k,), columns=columns),
            names.HESSIAN_CONVERGED: SeriesSpec(dtype="int8"),
            names.HESSIAN_N_HVP: SeriesSpec(dtype="int32", view=view(names.HESSIAN_N_HVP)),
            names.HESSIAN_LOSS: SeriesSpec(view=view(names.HESSIAN_LOSS)),
        }
        if self.trace_hvp:
            specs |= {
                names.HESSIAN_TRACE: SeriesSpec(view=view(names.HESSIAN_TRACE)),
                names.HESSIAN_TRACE_STDERR: SeriesSpec(),
            }
        if self.gradient_share:
            share = view(names.HESSIAN_GRADIENT_SHARE)
            specs[names.HESSIAN_GRADIENT_SHARE] = SeriesSpec(view=share)
        if self.density_runs:
            shape = (self.density_runs, self.density_steps)
            specs |= {
                names.HESSIAN_DENSITY_NODES: SeriesSpec(shape),
                names.HESSIAN_DENSITY_WEIGHTS: SeriesSpec(shape),
            }
        if self.eigenspace_overlap:
            specs |= {
                name: SeriesSpec(view=view(name))
                for name in (names.HESSIAN_OVERLAP, names.HESSIAN_UPDATE_SHARE)
            }
        groups = {self.name: specs}
        if self.vector_period:
            ritz = SeriesSpec((self.k, self._size), "float32")
            groups[names.HESSIAN_VECTORS] = {names.HESSIAN_VECTORS_RITZ: ritz}
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
        return {**self._loss.settings(), **solver}

    def on_step_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, step: int
    ) -> None:
        # Measured here, before the step's forward, so the row describes θ_step (the contract).
        self._row = self.measure(pl_module, step)

    def on_step_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        outputs: Any,
        step: int,
    ) -> Rows:
        row, self._row = self._row, None
        if row is None:
            return {}
        rows: Rows = {self.name: row}
        if self.vector_period and step % self.vector_period == 0:
            ritz = self._ritz[: self.k].float()
            rows[names.HESSIAN_VECTORS] = {names.HESSIAN_VECTORS_RITZ: ritz}
        return rows

    def measure(self, pl_module: pl.LightningModule, step: int) -> dict[str, Any]:
        """One row for the module's current parameters.

        Raises:
            FloatingPointError: if the loss, a product or a value of the row is NaN or infinite.
        """
        batch = self._loss.batch
        params = dict(pl_module.named_parameters())
        leaves = {n: params[n].detach().to(self.dtype).requires_grad_() for n in self._names}
        tensors = dict(leaves)
        if any(p.dtype != self.dtype for p in params.values()):
            # Lower-precision weights (bf16/fp16 "true" precision) are upcast for the pass; the
            # frozen parameters, the buffers and the batch follow so that every op runs in
            # float32.
            tensors |= frozen_parameters(pl_module, self.dtype, self._names)
            tensors |= {n: upcast(b, self.dtype) for n, b in pl_module.named_buffers()}
            batch = apply_to_collection(batch, torch.Tensor, upcast, self.dtype)
        averaged = world.is_distributed()
        with (
            side_effect_free(pl_module, self.mode),
            torch.autocast(pl_module.device.type, enabled=False),
            uncompiled(),  # a compiled graph supports no double backward
        ):
            operator = HessianOperator(
                lambda: loss_at(pl_module, tensors, batch),
                list(leaves.values()),
                average_across_ranks=averaged,
            )
            row = self._row_of(operator, step)
        not_finite = [
            name
            for name, value in row.items()
            if name not in MAY_BE_NAN and not np.isfinite(value).all()
        ]
        if not_finite:
            raise FloatingPointError(
                f"HessianSpectrum at step {step}: {', '.join(not_finite)} not finite"
            )
        return row

    def _row_of(self, operator: HessianOperator, step: int) -> dict[str, Any]:
        previous = None if self._ritz is None else self._ritz[: self.k]
        pairs = self._eigenpairs(operator, step)
        self._ritz = pairs.eigenvectors
        vectors = pairs.eigenvectors[: self.k]
        # From all the pairs the solver returns: a tracking solve's guards give the k-th a gap.
        bounds = eigenvalue_error_bounds(pairs.eigenvalues, pairs.residuals)
        row: dict[str, Any] = {
            names.HESSIAN_LOSS: operator.loss,
            names.HESSIAN_EIGENVALUES: pairs.eigenvalues[: self.k].float().numpy(),
            names.HESSIAN_RESIDUALS: pairs.residuals[: self.k].float().numpy(),
            names.HESSIAN_ERROR_BOUNDS: bounds[: self.k].float().numpy(),
            names.HESSIAN_CONVERGED: np.int8(pairs.converged),
        }
        if self.gradient_share:
            gradient = operator.gradient
            inside = torch.linalg.vector_norm(vectors @ gradient) ** 2
            row[names.HESSIAN_GRADIENT_SHARE] = (
                inside / torch.linalg.vector_norm(gradient) ** 2
            ).item()
        if self.eigenspace_overlap:
            theta = flatten(operator.params).detach()
            first = previous is None or self._theta is None
            row[names.HESSIAN_OVERLAP] = math.nan if first else subspace_overlap(vectors, previous)
            row[names.HESSIAN_UPDATE_SHARE] = (
                math.nan if first else update_share(theta - self._theta, previous)
            )
            self._theta = theta
        if self.trace_hvp:
            trace = hutch_plus_plus(operator, self.trace_hvp, seed=self.seed)
            row[names.HESSIAN_TRACE], row[names.HESSIAN_TRACE_STDERR] = trace.trace, trace.stderr
        if self.density_runs:
            density = spectral_density(
                operator, self.density_runs, self.density_steps, seed=self.seed
            )
            row[names.HESSIAN_DENSITY_NODES] = density.nodes.astype(np.float32)
            row[names.HESSIAN_DENSITY_WEIGHTS] = density.weights.astype(np.float32)
        row[names.HESSIAN_N_HVP] = operator.n_hvp
        return row

    def _eigenpairs(self, operator: HessianOperator, step: int) -> Eigenpairs:
        """The top k pairs (tracking: and the guards, to be tracked at the next row)."""
        if self.solver == "lanczos":
            warm = self._ritz if self.warm_start else None
            return lanczos(
                operator, self.k, self.tol, max_hvp=self.max_hvp, warm_start=warm, seed=self.seed
            )
        width = min(self.k + GUARDS, operator.size)
        cold_due = self.cold_every and step % (self.cold_every * self.every_n_steps) == 0
        if self._ritz is None or len(self._ritz) != width or cold_due:
            return lanczos(operator, width, self.tol, max_hvp=self.max_hvp, seed=self.seed)
        return track_eigenpairs(
            operator,
            self._ritz,
            self.tol,
            k=self.k,
            max_basis=self.max_basis,
            max_hvp=self.max_hvp,
            seed=self.seed,
        )

    def teardown(self) -> None:
        self._ritz = None
        self._theta = None
        self._row = None

    def state_dict(self) -> dict[str, Any]:
        # The warm-start vectors too: a resumed fit starts its next row's Lanczos where an
        # uninterrupted one would, so its rows are the same.
        ritz = {} if self._ritz is None else {"ritz": self._ritz.cpu()}
        theta = {} if self._theta is None else {"theta": self._theta.cpu()}
        return {**self._loss.state_dict(), **ritz, **theta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loss.load_state_dict(state)
        self._ritz = state.get("ritz")
        self._theta = state.get("theta")
