"""Where a step's loss change comes from: one exact term per parameter group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, get_args

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection

from dynamics.callbacks.fit import Fit
from dynamics.callbacks.probe import Probe, ProbeUnavailable, Rows, SeriesSpec
from dynamics.callbacks.probe_loss import ProbeLoss, frozen_parameters, uncompiled, upcast
from dynamics.params.groups import Grouping, ParameterGroups, group_parameters
from dynamics.params.naming import unwrapped_name
from dynamics.params.vectors import module_device
from dynamics.passes.isolation import Mode, side_effect_free
from dynamics.passes.loss_change import LossChange, split_loss_change
from dynamics.passes.loss_rule import loss_at
from dynamics.store import View, names

#: How the series are drawn (declared with them: no file written before them needs a table).
VIEWS = {
    names.LOSS_CHANGE_TERMS: View(
        "lines", "Loss change of one step per parameter group (probe batch)", "ΔL term"
    ),
    names.LOSS_CHANGE_SHARE: View(
        "lines", "Cumulative share of the loss change per parameter group (Σ term / Σ ΔL)", "share"
    ),
    names.LOSS_CHANGE_DELTA: View("scalar", "Loss change of one step (probe batch)", "ΔL"),
    names.LOSS_CHANGE_RELATIVE_RESIDUAL: View(
        "scalar", "Quadrature residual of the split", "|Σ terms − ΔL| / |ΔL|", log_y=True
    ),
}


class LossChangeSplit(Probe):
    """Splits the loss change of one optimizer step into one term per parameter group.

    What it records, cost, when it steps aside and pitfalls: ``docs/probes/loss_change_split.md``.

    Example::

        LossChangeSplit(groups="kind", every_n_steps=10)

    Args:
        groups: ``"kind"`` — ``bias`` (1-D ``bias``/``bias_*``/``*_bias`` parameters of
            non-normalization layers), ``weight`` and ``normalization`` (every parameter of a
            module whose class name contains ``Norm``), see :mod:`dynamics.params.groups` —
            or ``"layer"`` (one group per module owning parameters) or ``{group: [glob, ...]}``
            over dotted parameter names (unmatched parameters go to ``other``).
        every_n_steps: recording period in optimizer steps.
        nodes: Gauss–Legendre nodes per quadrature panel. Two close a smooth loss's step in one
            panel (teacher–student with GELU: 2 gradient evaluations per record); with ReLU
            more panels of few nodes beat fewer of many (the integrand jumps), so 2 is the
            default for both (``benchmarks/bench_loss_change_split.py``).
        rtol: relative tolerance of Σ terms against the measured ΔL.
        max_gradient_evaluations: budget per row; panels are bisected until the tolerance is met
            or the next bisection would exceed it.
        batch: the probe batch; default: a copy of the fit's first training batch.
        mode: ``"eval"`` or ``"train"``, the :data:`~dynamics.passes.isolation.Mode` of the module
            during the evaluations.
    """

    name = names.LOSS_CHANGE

    def __init__(
        self,
        groups: Grouping | Mapping[str, Sequence[str]] = "kind",
        every_n_steps: int = 10,
        *,
        nodes: int = 2,
        rtol: float = 1e-6,
        max_gradient_evaluations: int = 256,
        batch: Any = None,
        mode: Mode = "eval",
    ) -> None:
        super().__init__(every_n_steps)
        if nodes < 1 or max_gradient_evaluations < nodes or not rtol > 0:
            raise ValueError(
                "LossChangeSplit needs nodes >= 1, max_gradient_evaluations >= nodes and "
                f"rtol > 0, got {nodes}, {max_gradient_evaluations} and {rtol}"
            )
        if groups not in get_args(Grouping) and not isinstance(groups, Mapping):
            raise ValueError(f"groups must be 'kind', 'layer' or a mapping, got {groups!r}")
        self.groups = groups if isinstance(groups, str) else {g: list(p) for g, p in groups.items()}
        self.nodes = nodes
        self.rtol = rtol
        self.max_gradient_evaluations = max_gradient_evaluations
        self._loss = ProbeLoss("LossChangeSplit", mode, batch)
        self.grouping: ParameterGroups | None = None  # found at setup
        self._params: list[torch.Tensor] = []
        self._before: tuple[list[torch.Tensor], dict[str, torch.Tensor]] | None = None
        # Running sums over the recorded steps, for the cumulative share.
        self._sum_terms: np.ndarray | None = None
        self._sum_delta = 0.0

    @property
    def mode(self) -> Mode:
        return self._loss.mode

    def setup(self, fit: Fit, pl_module: pl.LightningModule, batch: Any) -> None:
        self._loss.setup(fit, pl_module, batch)
        with self._loss.whole(pl_module) as module:  # groups by the layers, not by the shards
            self.grouping = group_parameters(module, self.groups)
        if not self._loss.shards.sharded:
            found = dict(pl_module.named_parameters())
            self._params = [found[n] for n in self.grouping.parameters]
        if self._sum_terms is None:  # a resumed fit restored the sums
            self._sum_terms = np.zeros(len(self.grouping.names))

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        if self.grouping is None:
            return {}  # the columns are the groups, known at setup

        def spec(series: str, shape: tuple[int, ...] = (), dtype: str = "float64") -> SeriesSpec:
            columns = self.grouping.names if shape else None
            return SeriesSpec(shape, dtype, columns=columns, view=VIEWS.get(series))

        groups = (len(self.grouping.names),)
        return {
            names.LOSS_CHANGE: {
                names.LOSS_CHANGE_TERMS: spec(names.LOSS_CHANGE_TERMS, groups),
                names.LOSS_CHANGE_SHARE: spec(names.LOSS_CHANGE_SHARE, groups),
                names.LOSS_CHANGE_DELTA: spec(names.LOSS_CHANGE_DELTA),
                names.LOSS_CHANGE_LOSS: spec(names.LOSS_CHANGE_LOSS),
                names.LOSS_CHANGE_RESIDUAL: spec(names.LOSS_CHANGE_RESIDUAL),
                names.LOSS_CHANGE_RELATIVE_RESIDUAL: spec(names.LOSS_CHANGE_RELATIVE_RESIDUAL),
                names.LOSS_CHANGE_CONVERGED: spec(names.LOSS_CHANGE_CONVERGED, dtype="int8"),
                names.LOSS_CHANGE_EVALUATIONS: spec(names.LOSS_CHANGE_EVALUATIONS, dtype="int32"),
                names.LOSS_CHANGE_OPTIMIZER_STEPS: spec(
                    names.LOSS_CHANGE_OPTIMIZER_STEPS, dtype="int32"
                ),
            }
        }

    def settings(self) -> dict[str, Any]:
        if self.grouping is None:
            return {}
        return {
            **self._loss.settings(),
            "groups": {g: self.grouping.members(g) for g in self.grouping.names},
            "nodes": self.nodes,
            "rtol": self.rtol,
            "max_gradient_evaluations": self.max_gradient_evaluations,
            "float_bits": 64,
            "buffers": "as before the step",
        }

    def on_step_start(self, fit, pl_module, batch, step) -> None:
        # Rank zero measures and writes (the ranks' θ agree); under sharding every rank keeps
        # its pieces of θ, which rank zero gathers at the step's end, and the buffers (whole on
        # every rank) go by the names the whole-parameter copy has.
        sharded = self._loss.shards.sharded
        if not (sharded or fit.is_global_zero):
            return
        buffers = {}
        if fit.is_global_zero:
            buffers = {
                unwrapped_name(n) if sharded else n: b.detach().clone()
                for n, b in pl_module.named_buffers()
            }
        if sharded:
            self._before = ([p.clone() for p in self._loss.shards.pieces(pl_module)], buffers)
        else:
            self._before = ([p.detach().clone() for p in self._params], buffers)

    def on_step_end(self, fit, pl_module, batch, outputs, step) -> Rows:
        if self._before is None:
            return {}
        (start, buffers), self._before = self._before, None
        if self._loss.shards.sharded:
            split = self._measure_sharded(pl_module, start, buffers)
            if split is None:
                return {}
        else:
            split = self.measure(pl_module, start, [p.detach() for p in self._params], buffers)
        spanned = fit.global_step - step
        if spanned > 1:
            self.note(
                step,
                "Δθ spans several optimizer steps taken in one training batch (manual "
                "optimization): the row splits the change over the whole batch",
            )
        if split.loss_dtype != torch.float64:
            self.note(step, _coarse_loss_note(split.loss_dtype))
        if not split.converged:
            self.note(
                step,
                f"the terms missed ΔL by more than the tolerance (rtol={self.rtol:g}, never "
                f"below a thousand roundings of the loss in {_bits(split.loss_dtype)}) within "
                f"{self.max_gradient_evaluations} gradient evaluations (kinked activations such "
                "as ReLU make the integrand jump); such rows keep converged = 0 and their residual",
            )
        self._sum_terms = self._sum_terms + split.terms
        self._sum_delta += split.delta
        share = self._sum_terms / self._sum_delta if self._sum_delta else self._sum_terms * np.nan
        relative = abs(split.residual) / abs(split.delta) if split.delta else np.nan
        return {
            names.LOSS_CHANGE: {
                names.LOSS_CHANGE_TERMS: split.terms,
                names.LOSS_CHANGE_SHARE: share,
                names.LOSS_CHANGE_DELTA: np.float64(split.delta),
                names.LOSS_CHANGE_LOSS: np.float64(split.loss_before),
                names.LOSS_CHANGE_RESIDUAL: np.float64(split.residual),
                names.LOSS_CHANGE_RELATIVE_RESIDUAL: np.float64(relative),
                names.LOSS_CHANGE_CONVERGED: np.int8(split.converged),
                names.LOSS_CHANGE_EVALUATIONS: np.int32(split.gradient_evaluations),
                names.LOSS_CHANGE_OPTIMIZER_STEPS: np.int32(spanned),
            }
        }

    def measure(
        self,
        pl_module: pl.LightningModule,
        start: Sequence[torch.Tensor],
        end: Sequence[torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
    ) -> LossChange:
        """The split of L(end) − L(start) on the probe batch, every evaluation in float64 with
        ``buffers`` standing for the module's (and the module left as it was)."""
        dtype = torch.float64
        names_ = self.grouping.parameters
        fixed = {n: upcast(b, dtype) for n, b in buffers.items()}
        fixed |= frozen_parameters(pl_module, dtype, names_)
        batch = apply_to_collection(self._loss.batch, torch.Tensor, upcast, dtype)
        device = module_device(pl_module)
        rule = self._loss.rule
        rng_devices = [device.index or 0] if device.type == "cuda" else []

        def loss(tensors: list[torch.Tensor]) -> torch.Tensor:
            # Each evaluation from the same RNG state: one dropout mask along the segment.
            with torch.random.fork_rng(devices=rng_devices):
                return loss_at(pl_module, {**fixed, **dict(zip(names_, tensors))}, batch, rule)

        with (
            side_effect_free(pl_module, self.mode),
            torch.autocast(device.type, enabled=False),
            uncompiled(),  # float64 evaluations would recompile the graph, or fail in it
        ):
            return split_loss_change(
                loss,
                [t.to(dtype) for t in start],
                [t.to(dtype) for t in end],
                self.grouping.index,
                nodes=self.nodes,
                rtol=self.rtol,
                max_gradient_evaluations=self.max_gradient_evaluations,
            )

    def _measure_sharded(
        self,
        pl_module: pl.LightningModule,
        pieces: list[torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
    ) -> LossChange | None:
        """:meth:`measure` on the whole-parameter copy (every rank gathers; rank zero alone
        measures, None elsewhere). A failure on rank zero is every rank's, so that no rank
        gathers for a probe the others have given up (one small all-reduce)."""
        shards = self._loss.shards
        with self._loss.whole(pl_module) as module:
            flat = shards.gather(torch.cat(pieces))
            split, error = None, None
            if flat is not None:
                tensors = dict(zip(shards.layout.names, shards.layout.split(flat)))
                found = dict(module.named_parameters())
                names_ = self.grouping.parameters
                try:
                    split = self.measure(
                        module,
                        [tensors[n] for n in names_],
                        [found[n].detach() for n in names_],
                        buffers,
                    )
                except Exception as failure:  # raised below, after every rank knows
                    error = failure
        (failed,) = shards.sum([pieces[0].new_tensor(float(error is not None))])
        if error is not None:
            raise error
        if failed:
            raise ProbeUnavailable(
                "LossChangeSplit: rank zero's measurement failed (its event says why)"
            )
        return split

    def teardown(self) -> None:
        self._before = None

    def state_dict(self) -> dict[str, Any]:
        sums = {}
        if self._sum_terms is not None:
            sums = {"sum_terms": torch.from_numpy(self._sum_terms), "sum_delta": self._sum_delta}
        return {**self._loss.state_dict(), **sums}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loss.load_state_dict(state)
        if "sum_terms" in state:
            self._sum_terms = state["sum_terms"].numpy().copy()
            self._sum_delta = float(state["sum_delta"])


def _bits(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _coarse_loss_note(dtype: torch.dtype) -> str:
    """Why the rows resolve ΔL only to the loss's own precision."""
    return (
        f"the module's loss comes back in {_bits(dtype)} though every evaluation runs in float64 "
        "(the model casts to it, as a Hugging Face causal LM casts its logits): ΔL and the "
        f"terms are resolved to {_bits(dtype)}'s precision, and the tolerance is taken from its "
        "eps, not float64's"
    )
