"""The geometry of the training path: its length, how winding it is, and where updates point."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from dynamics.callbacks.probe import Probe, Rows, SeriesSpec
from dynamics.params.layout import ParameterLayout
from dynamics.store import View, names

if TYPE_CHECKING:
    import pytorch_lightning as pl

#: How the series are drawn (declared with them).
VIEWS = {
    names.TRAJECTORY_PATH_LENGTH: View("scalar", "Path length Σ‖θs+1 − θs‖", "path length"),
    names.TRAJECTORY_TORTUOSITY: View(
        "scalar", "Tortuosity: path length / ‖θt+1 − θ0‖", "tortuosity", log_y=True
    ),
    names.TRAJECTORY_UPDATE_COSINE: View(
        "scalar", "Cosine between consecutive updates", "cos(Δt−1, Δt)"
    ),
    names.TRAJECTORY_GRADIENT_COSINE: View(
        "scalar", "Cosine between the update and the descent direction", "cos(Δt, −gt)"
    ),
}
#: How the per-tensor series are drawn: tensors as lines, as the per-tensor displacement.
TENSOR_VIEWS = {
    names.TRAJECTORY_PATH_LENGTH_PER_TENSOR: View(
        "lines", "Path length per tensor Σ‖θs+1,i − θs,i‖", "path length"
    ),
    names.TRAJECTORY_UPDATE_COSINE_PER_TENSOR: View(
        "lines", "Cosine between consecutive updates per tensor", "cos(Δt−1,i, Δt,i)"
    ),
    names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR: View(
        "lines",
        "Cosine between the update and the descent direction per tensor",
        "cos(Δt,i, −gt,i)",
    ),
}
#: The total series each per-tensor series breaks down.
_TOTAL_OF = {
    names.TRAJECTORY_PATH_LENGTH_PER_TENSOR: names.TRAJECTORY_PATH_LENGTH,
    names.TRAJECTORY_UPDATE_COSINE_PER_TENSOR: names.TRAJECTORY_UPDATE_COSINE,
    names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR: names.TRAJECTORY_GRADIENT_COSINE,
}

#: What the gradient of a row is, stored with the probe's settings.
GRADIENT_DEFINITION = (
    "the gradient in .grad of the parameters the optimizers hold when the step's optimizer "
    "step has returned: the sum over the step's micro-batches of the gradients of the losses "
    "Lightning backpropagated (each divided by accumulate_grad_batches), after Lightning's "
    "gradient clipping and AMP unscaling; zero for a parameter without a gradient or outside "
    "every optimizer"
)


class TrajectoryGeometry(Probe):
    """Path length, tortuosity and the directions of the updates, per optimizer step.

    What it records, cost, when it steps aside and pitfalls: ``docs/probes/trajectory_geometry.md``.

    Example::

        TrajectoryGeometry(per_tensor=True)

    Args:
        every_n_steps: period of the rows in optimizer steps.
        per_tensor: also record the path length and the cosines per parameter tensor.
    """

    name = names.TRAJECTORY

    def __init__(self, every_n_steps: int = 1, per_tensor: bool = False) -> None:
        super().__init__(every_n_steps)
        self.per_tensor = per_tensor
        self.gradient_problem: str | None = None  # why the gradient cannot be known, at setup
        self.tensor_problem: str | None = None  # why the per-tensor series cannot be, at setup
        self._tensor_names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._in_optimizer: list[bool] = []  # per parameter: does an optimizer hold it
        self._theta0: list[torch.Tensor] | None = None
        self._before: list[torch.Tensor] = []  # θt, copied before a step
        self._previous: list[torch.Tensor] | None = None  # Δt−1 / ‖Δt−1‖
        self._path: torch.Tensor | None = None  # Σ ‖Δs‖ so far
        self._tensor_path: torch.Tensor | None = None  # Σ ‖Δs,i‖ so far, per tensor i
        self._previous_tensors: list[torch.Tensor] | None = None  # Δt−1,i / ‖Δt−1,i‖
        self._zeros: dict[int, torch.Tensor] = {}  # stand-ins for missing gradients
        self._armed = False
        self._noted: set[str] = set()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        layout = ParameterLayout.of(pl_module)
        self._params = layout.parameters(pl_module)
        self._tensor_names = list(layout.names)
        held = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
        self._in_optimizer = [id(p) in held for p in self._params]
        self.gradient_problem = _gradient_problem(trainer, pl_module)
        if self.gradient_problem:
            self._note_once(
                trainer.global_step, f"gradient_cosine not recorded: {self.gradient_problem}"
            )
        device = self._params[0].device
        params = [p.detach() for p in self._params]
        if self._theta0 is None:  # a resumed fit restored its state from the checkpoint
            self._theta0 = [p.to(_work_dtype(p)).clone() for p in params]
            # float64 keeps the sum of many small lengths exact enough; MPS has no float64.
            accumulator = torch.float32 if device.type == "mps" else torch.float64
            self._path = torch.zeros((), dtype=accumulator)
            if self.per_tensor:
                self._tensor_path = torch.zeros(len(params), dtype=accumulator)
        elif self.per_tensor and self._tensor_path is None:
            self.tensor_problem = (
                "resumed from a checkpoint of a fit without per_tensor, so the per-tensor path "
                "lengths so far are unknown"
            )
            self._note_once(
                trainer.global_step, f"per-tensor series not recorded: {self.tensor_problem}"
            )
        if not self.per_tensor:  # a checkpoint of a fit with per_tensor: not continued
            self._tensor_path, self._previous_tensors = None, None
        self._theta0 = [t.to(device) for t in self._theta0]
        self._path = self._path.to(device)
        if self._previous is not None:
            self._previous = [t.to(device) for t in self._previous]
        if self._tensor_path is not None:
            self._tensor_path = self._tensor_path.to(device)
        if self._previous_tensors is not None:
            self._previous_tensors = [t.to(device) for t in self._previous_tensors]
        self._before = [torch.empty_like(t) for t in self._theta0]

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        measured = list(VIEWS)
        if self.gradient_problem:
            measured.remove(names.TRAJECTORY_GRADIENT_COSINE)
        series = {name: SeriesSpec(view=VIEWS[name]) for name in measured}
        if self._tensor_path is not None:
            shape, columns = (len(self._tensor_names),), tuple(self._tensor_names)
            series.update(
                (name, SeriesSpec(shape, columns=columns, view=view))
                for name, view in TENSOR_VIEWS.items()
                if _TOTAL_OF[name] in measured
            )
        return {names.TRAJECTORY: series}

    def settings(self) -> dict[str, Any]:
        gradient = GRADIENT_DEFINITION
        if self.gradient_problem:
            gradient = f"not measured: {self.gradient_problem}"
        settings = {"measured": "every optimizer step", "gradient": gradient}
        if self.per_tensor:  # only then: the settings of files without the option stay as they were
            settings["per_tensor"] = (
                f"not measured: {self.tensor_problem}" if self.tensor_problem else True
            )
        return settings

    def is_due(self, step: int) -> bool:
        return True  # every update counts in the path; rows are thinned in on_step_end

    def on_step_start(self, trainer, pl_module, batch, step) -> None:
        if trainer.is_global_zero:  # only rank 0 writes, and the ranks' parameters agree
            torch._foreach_copy_(self._before, [p.detach() for p in self._params])
            self._armed = True

    def on_step_end(self, trainer, pl_module, batch, outputs, step) -> Rows:
        if not self._armed:
            return {}
        self._armed = False
        params = [p.detach() for p in self._params]
        update = torch._foreach_sub(params, self._before)
        norms = _norms(update)
        length = torch.linalg.vector_norm(norms)
        self._path += length
        # θt is no longer needed: its buffer takes θt+1 − θ0.
        torch._foreach_copy_(self._before, params)
        torch._foreach_sub_(self._before, self._theta0)
        distance = _norm(self._before)
        directions = None  # per tensor Δt,i / ‖Δt,i‖
        if self._tensor_path is not None:
            self._tensor_path += norms
            directions = torch._foreach_div(update, list(norms.unbind()))
        torch._foreach_div_(update, length)  # the direction; NaN where the update is zero
        previous, self._previous = self._previous, update
        previous_directions, self._previous_tensors = self._previous_tensors, directions
        if not super().is_due(step):
            return {}
        nan = torch.full((), math.nan, device=length.device)
        rows = {
            names.TRAJECTORY_PATH_LENGTH: self._path.clone(),
            names.TRAJECTORY_TORTUOSITY: self._path / distance,
            names.TRAJECTORY_UPDATE_COSINE: (
                nan if previous is None else _unit_cosine(update, previous)
            ),
        }
        if directions is not None:
            rows[names.TRAJECTORY_PATH_LENGTH_PER_TENSOR] = self._tensor_path.clone()
            rows[names.TRAJECTORY_UPDATE_COSINE_PER_TENSOR] = (
                torch.full_like(norms, math.nan)
                if previous_directions is None
                else _unit_cosines(directions, previous_directions)
            )
        if self.gradient_problem is None:
            rows.update(self._gradient_cosines(update, directions, step))
        return {names.TRAJECTORY: rows}

    def teardown(self) -> None:
        # The next fit() starts a new path, unless a checkpoint restores this one.
        self._theta0, self._previous, self._path = None, None, None
        self._tensor_path, self._previous_tensors, self.tensor_problem = None, None, None
        self._before, self._zeros, self._armed = [], {}, False

    def state_dict(self) -> dict[str, Any]:
        if self._theta0 is None:
            return {}
        return {
            "theta0": [t.cpu() for t in self._theta0],
            "path": self._path.cpu(),
            "previous": None if self._previous is None else [t.cpu() for t in self._previous],
            "tensor_path": None if self._tensor_path is None else self._tensor_path.cpu(),
            "previous_tensors": (
                None
                if self._previous_tensors is None
                else [t.cpu() for t in self._previous_tensors]
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._theta0 = state.get("theta0")
        self._path = state.get("path")
        self._previous = state.get("previous")
        self._tensor_path = state.get("tensor_path")
        self._previous_tensors = state.get("previous_tensors")

    def _gradient_cosines(
        self,
        direction: list[torch.Tensor],
        directions: list[torch.Tensor] | None,
        step: int,
    ) -> dict[str, torch.Tensor]:
        """cos(Δt, −gt) = 1 − ‖Δ̂ + ĝ‖²/2 from the update's direction Δ̂ (see _unit_cosine),
        and per tensor from its directions ``directions`` when given (else not)."""
        grads = [
            p.grad if held and p.grad is not None else None
            for p, held in zip(self._params, self._in_optimizer)
        ]
        if all(g is None for g in grads):
            self._note_once(
                step,
                "no parameter had a gradient when the optimizer step ended; gradient_cosine "
                "recorded NaN",
            )
            nan = torch.full((len(direction),), math.nan, device=direction[0].device)
            rows = {names.TRAJECTORY_GRADIENT_COSINE: nan[0]}
            if directions is not None:
                rows[names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR] = nan
            return rows
        gradient = [
            g.to(d.dtype) if g is not None else self._zero(i, d)
            for i, (g, d) in enumerate(zip(grads, direction))
        ]
        norms = _norms(gradient)
        unit = torch._foreach_div(gradient, torch.linalg.vector_norm(norms))
        torch._foreach_add_(unit, direction)
        rows = {names.TRAJECTORY_GRADIENT_COSINE: (1 - _norm(unit) ** 2 / 2).clamp(-1, 1)}
        if directions is not None:
            # A tensor without a gradient (a zero stand-in) gets 0/0: NaN, no direction.
            units = torch._foreach_div(gradient, list(norms.unbind()))
            torch._foreach_add_(units, directions)
            rows[names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR] = (1 - _norms(units) ** 2 / 2).clamp(
                -1, 1
            )
        return rows

    def _zero(self, i: int, like: torch.Tensor) -> torch.Tensor:
        if i not in self._zeros:
            self._zeros[i] = torch.zeros_like(like)
        return self._zeros[i]

    def _note_once(self, step: int, message: str) -> None:
        if message not in self._noted:
            self._noted.add(message)
            self.note(step, message)


def _gradient_problem(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """Why the gradient an update was made from cannot be known, or None."""
    if not pl_module.automatic_optimization:
        return (
            "manual optimization: the module calls zero_grad, backward, clipping and step "
            "itself, possibly for several optimizers, so .grad after the batch need not be the "
            "gradient any step used"
        )
    if any(isinstance(opt, torch.optim.LBFGS) for opt in trainer.optimizers):
        return (
            "LBFGS evaluates the gradient several times per step; .grad holds the last "
            "evaluation's, not the one its update was made from"
        )
    return None


def _work_dtype(p: torch.Tensor) -> torch.dtype:
    # Differences and directions of half-precision parameters would round to 2⁻⁸..2⁻¹¹.
    return torch.promote_types(p.dtype, torch.float32)


def _unit_cosine(u: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
    """cos(u, v) of unit vectors as 1 − ‖u − v‖²/2: accurate near ±1, unlike a dot product."""
    return (1 - _norm(torch._foreach_sub(u, v)) ** 2 / 2).clamp(-1, 1)


def _unit_cosines(u: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
    """cos(uᵢ, vᵢ) per tensor of tensors of unit norm, as :func:`_unit_cosine`."""
    return (1 - _norms(torch._foreach_sub(u, v)) ** 2 / 2).clamp(-1, 1)


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The Euclidean norm of each tensor, stacked: one foreach kernel."""
    return torch.stack(torch._foreach_norm(tensors))


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The Euclidean norm of the vector the tensors make up, one foreach kernel."""
    return torch.linalg.vector_norm(_norms(tensors))
