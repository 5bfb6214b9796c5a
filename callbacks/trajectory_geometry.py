"""The geometry of the training path: its length, how winding it is, and where updates point."""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from dynamics.callbacks.fit import Fit
from dynamics.callbacks.probe import Probe, Rows, SeriesSpec, parameter_shards
from dynamics.params.naming import named_parameters
from dynamics.sharding import ParameterShards
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
        self._shards: ParameterShards | None = None  # which entries of θ this rank holds
        # Detached views of the parameters, unsharded; under sharding this rank's pieces are
        # looked up each step (FSDP may rebind them).
        self._params: list[torch.Tensor] = []
        self._in_optimizer: list[bool] = []  # per parameter: does an optimizer hold it
        self._params_held: list[torch.Tensor] = []  # the parameters themselves, for .grad
        self._module: pl.LightningModule | None = None  # whose shards' .grad is read, sharded
        # Per tensor: the gradient its optimizer was handed this step, read when the step
        # returned (a plain loop may zero .grad before the step ends), or None. Unsharded,
        # views of the copies in _grad_copies.
        self._grads: list[torch.Tensor | None] = []
        self._grad_copies: list[torch.Tensor | None] = []
        self._hooks: list[Any] = []  # on the optimizers' steps
        self._zeros: dict[int, torch.Tensor] = {}  # stand-ins for missing gradients
        self._theta0: list[torch.Tensor] | None = None  # this rank's part under sharding
        self._before: list[torch.Tensor] = []  # θt, copied before a step
        # Δt−1, or a positive multiple of it (a checkpoint of an older version holds its
        # direction): cosines do not see the scale. Its squared norms per tensor, summed
        # over the ranks, beside it.
        self._previous: list[torch.Tensor] | None = None
        self._previous_squares: torch.Tensor | None = None
        self._path: torch.Tensor | None = None  # Σ ‖Δs‖ so far
        self._tensor_path: torch.Tensor | None = None  # Σ ‖Δs,i‖ so far, per tensor i
        self._sums = torch.float64  # the accumulators' dtype (MPS has no float64)
        self._armed = False
        self._noted: set[str] = set()

    def setup(self, fit: Fit, pl_module: pl.LightningModule, batch: Any) -> None:
        shards = self._shards = parameter_shards(fit, pl_module)
        self._tensor_names = list(shards.layout.names)
        found = dict(named_parameters(pl_module))
        params = [found[n] for n in self._tensor_names]
        held = {id(p) for opt in fit.optimizers for g in opt.param_groups for p in g["params"]}
        self._in_optimizer = [id(p) in held for p in params]
        self._params_held = params
        self._params = [] if shards.sharded else [p.detach() for p in params]
        self.gradient_problem = _gradient_problem(fit, pl_module)
        if self.gradient_problem:
            self._note_once(
                fit.global_step, f"gradient_cosine not recorded: {self.gradient_problem}"
            )
        pieces = self._pieces(pl_module)
        device = pieces[0].device
        self._grads = [None] * len(pieces)
        if self.gradient_problem is None:
            self._watch_steps(fit, pl_module, pieces)
        # float64 keeps the sum of many small lengths exact enough; MPS has no float64.
        self._sums = torch.float32 if device.type == "mps" else torch.float64
        if self._theta0 is None:  # a new path (a resumed fit restored its whole state instead)
            self._theta0 = [p.to(_work_dtype(p)).clone() for p in pieces]
            self._path = torch.zeros((), dtype=self._sums)
            if self.per_tensor:
                self._tensor_path = torch.zeros(len(pieces), dtype=self._sums)
        else:
            self._theta0 = self._parts(self._theta0, pieces)
            if self._previous is not None:
                self._previous = self._parts(self._previous, pieces)
                if self._previous_squares is None:  # an older, unsharded fit's checkpoint
                    self._previous_squares = _squares(self._previous, self._sums)
            if self.per_tensor and self._tensor_path is None:
                self.tensor_problem = (
                    "resumed from a checkpoint of a fit without per_tensor, so the per-tensor "
                    "path lengths so far are unknown"
                )
                self._note_once(
                    fit.global_step, f"per-tensor series not recorded: {self.tensor_problem}"
                )
        if not self.per_tensor:  # a checkpoint of a fit with per_tensor: not continued
            self._tensor_path = None
        self._path = self._path.to(device)
        if self._previous_squares is not None:
            self._previous_squares = self._previous_squares.to(device, self._sums)
        if self._tensor_path is not None:
            self._tensor_path = self._tensor_path.to(device)
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

    def on_step_start(self, fit, pl_module, batch, step) -> None:
        # Unsharded only rank 0 works (it writes, and the ranks' parameters agree); sharded,
        # every rank holds a part and takes part in the step's all-reduce.
        if fit.is_global_zero or self._shards.sharded:
            torch._foreach_copy_(self._before, self._pieces(pl_module))
            self._grads = [None] * len(self._grads)
            self._armed = True

    def on_step_end(self, fit, pl_module, batch, outputs, step) -> Rows:
        if not self._armed:
            return {}
        self._armed = False
        params = self._pieces(pl_module)
        update = torch._foreach_sub(params, self._before)
        # θt is no longer needed: its buffer takes θt+1 − θ0.
        torch._foreach_copy_(self._before, params)
        torch._foreach_sub_(self._before, self._theta0)
        previous, self._previous = self._previous, update
        # Every quantity is a sum per tensor over this rank's entries, all summed over the
        # ranks in one all-reduce: ‖Δt‖², ‖θt+1 − θ0‖², ‖Δt ∓ Δt−1‖², and for the gradient
        # ‖gt‖² and ⟨Δt, gt⟩. Every rank stacks the same rows.
        zeros = torch.zeros(len(update), dtype=self._sums, device=self._path.device)
        squares = [_squares(update, self._sums), _squares(self._before, self._sums)]
        if previous is None:
            squares += [zeros, zeros]
        else:
            squares += [
                _squares(torch._foreach_sub(update, previous), self._sums),
                _squares(torch._foreach_add(update, previous), self._sums),
            ]
        if self.gradient_problem is None:
            gradient = self._gradient(update, step)
            squares += (
                [zeros, zeros]
                if gradient is None
                else [_squares(gradient, self._sums), _dots(update, gradient, self._sums)]
            )
        (sums,) = self._shards.sum([torch.stack(squares)])
        length2, distance2, minus, plus, *gradient_sums = sums
        previous2, self._previous_squares = self._previous_squares, length2
        norms = length2.sqrt()
        self._path += length2.sum().sqrt()
        if self._tensor_path is not None:
            self._tensor_path += norms
        if not super().is_due(step):
            return {}
        nan = torch.full((), math.nan, dtype=self._sums, device=norms.device)
        rows = {
            names.TRAJECTORY_PATH_LENGTH: self._path.clone(),
            names.TRAJECTORY_TORTUOSITY: self._path / distance2.sum().sqrt(),
            names.TRAJECTORY_UPDATE_COSINE: (
                nan
                if previous is None
                else _cosine(length2.sum(), previous2.sum(), minus.sum(), plus.sum())
            ),
        }
        if self._tensor_path is not None:
            rows[names.TRAJECTORY_PATH_LENGTH_PER_TENSOR] = self._tensor_path.clone()
            rows[names.TRAJECTORY_UPDATE_COSINE_PER_TENSOR] = (
                torch.full_like(norms, math.nan)
                if previous is None
                else _cosine(length2, previous2, minus, plus)
            )
        if gradient_sums:
            # A dot product, not the law of cosines: ‖Δt‖ and ‖gt‖ differ by the learning
            # rate's order, and ‖Δt ± gt‖² would lose that many digits to cancellation. A
            # tensor without a gradient (a zero stand-in) gets 0/0: NaN, no direction.
            gradient2, dot = gradient_sums
            rows[names.TRAJECTORY_GRADIENT_COSINE] = _dot_cosine(
                length2.sum(), gradient2.sum(), -dot.sum()
            )
            if self._tensor_path is not None:
                rows[names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR] = _dot_cosine(
                    length2, gradient2, -dot
                )
        return {names.TRAJECTORY: rows}

    def teardown(self) -> None:
        # The next fit() starts a new path, unless a checkpoint restores this one.
        self._theta0, self._previous, self._path = None, None, None
        self._previous_squares, self._tensor_path, self.tensor_problem = None, None, None
        self._before, self._zeros, self._armed = [], {}, False
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._params_held, self._module = [], [], None
        self._grads, self._grad_copies = [], []

    def state_dict(self) -> dict[str, Any]:
        if self._theta0 is None:
            return {}
        # Lightning saves a checkpoint on every rank together, keeps rank zero's states and
        # gives them to every rank of a resumed fit: under sharding the ranks' parts of θ0 and
        # of the last update are gathered to rank zero here. The sums are the ranks' already.
        theta0 = self._whole(self._theta0)
        previous = None if self._previous is None else self._whole(self._previous)
        if theta0 is None:
            return {}  # ranks but zero under sharding: their states are not kept
        return {
            "theta0": theta0,
            "path": self._path.cpu(),
            "previous": previous,
            "previous_squares": (
                None if self._previous_squares is None else self._previous_squares.cpu()
            ),
            "tensor_path": None if self._tensor_path is None else self._tensor_path.cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._theta0 = state.get("theta0")  # whole tensors: setup takes this rank's part
        self._path = state.get("path")
        self._previous = state.get("previous")
        self._previous_squares = state.get("previous_squares")
        self._tensor_path = state.get("tensor_path")

    def _whole(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The whole tensors, on the host, of which ``tensors`` are this rank's parts under
        sharding (None on ranks but zero; every rank must call it), else ``tensors`` there."""
        if self._shards is None or not self._shards.sharded:  # whole (or restored, whole)
            return [t.cpu() for t in tensors]
        layout = self._shards.layout
        flat = self._shards.gather(torch.cat([t.reshape(-1) for t in tensors]))
        if flat is None:
            return None
        return [
            whole.view(shape).to(t.dtype).cpu()
            for whole, shape, t in zip(torch.split(flat, layout.numels), layout.shapes, tensors)
        ]

    def _pieces(self, pl_module: pl.LightningModule) -> list[torch.Tensor]:
        """The parameters as the probe reads them: whole tensors, or this rank's pieces."""
        return self._shards.pieces(pl_module) if self._shards.sharded else self._params

    def _parts(self, tensors: list[torch.Tensor], pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's part of whole restored ``tensors``, shaped and placed as ``pieces``."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        parts = torch.split(self._shards.part(flat), self._shards.here)
        return [t.to(p.device).view(p.shape) for t, p in zip(parts, pieces)]

    def _watch_steps(
        self, fit: Fit, pl_module: pl.LightningModule, pieces: list[torch.Tensor]
    ) -> None:
        """Hook every optimizer's step to read the gradients of the tensors it holds."""
        self._module = pl_module
        index = {id(p): i for i, p in enumerate(self._params_held)}
        self._grad_copies = [
            torch.empty_like(p, dtype=_work_dtype(p)) if held and not self._shards.sharded else None
            for p, held in zip(pieces, self._in_optimizer)
        ]
        for opt in fit.optimizers:
            ids = {id(p) for g in opt.param_groups for p in g["params"]}
            mine = sorted(i for key, i in index.items() if key in ids)
            # Each optimizer's hook reads its own tensors: with several optimizers, each
            # tensor's gradient is the one its own optimizer stepped with.
            self._hooks.append(opt.register_step_post_hook(partial(self._stepped, mine)))

    def _stepped(
        self, tensors: list[int], optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> None:
        """When an optimizer's step returns, .grad of its tensors is what it was handed (after
        clipping and unscaling; only the real step under accumulation): keep it."""
        if not self._armed:
            return
        if self._shards.sharded:
            flat = self._shards.local_grad(self._module)  # a copy: this rank's part
            if flat is not None:
                parts = torch.split(flat, self._shards.here)
                for i in tensors:
                    self._grads[i] = parts[i]
            return
        present = [i for i in tensors if self._params_held[i].grad is not None]
        if present:  # one foreach copy, on the device: no host sync
            copies = [self._grad_copies[i] for i in present]
            torch._foreach_copy_(copies, [self._params_held[i].grad for i in present])
            for i, copy in zip(present, copies):
                self._grads[i] = copy

    def _gradient(self, like: list[torch.Tensor], step: int) -> list[torch.Tensor] | None:
        """This rank's part of the gradient per tensor the optimizers stepped with, shaped as
        ``like`` (zeros for a parameter outside every optimizer, without a gradient or whose
        optimizer did not step), or None (with a note) when no optimizer stepped with one."""
        grads = self._grads
        # Under sharding a rank may hold entries of frozen parameters only: it adds zeros, and
        # whether any rank had a gradient shows in the row (NaN when none had).
        if all(g is None for g in grads) and not self._shards.sharded:
            self._note_once(
                step,
                "no optimizer stepped with a gradient this step; gradient_cosine recorded NaN",
            )
            return None
        return [
            g.view(d.shape).to(d.dtype) if g is not None else self._zero(i, d)
            for i, (g, d) in enumerate(zip(grads, like))
        ]

    def _zero(self, i: int, like: torch.Tensor) -> torch.Tensor:
        if i not in self._zeros:
            self._zeros[i] = torch.zeros_like(like)
        return self._zeros[i]

    def _note_once(self, step: int, message: str) -> None:
        if message not in self._noted:
            self._noted.add(message)
            self.note(step, message)


def _gradient_problem(fit: Fit, pl_module: pl.LightningModule) -> str | None:
    """Why the gradient an update was made from cannot be known, or None."""
    # A LightningModule's flag; a plain module (a plain loop, the Hugging Face Trainer) steps
    # its optimizers the automatic way.
    if not getattr(pl_module, "automatic_optimization", True):
        return (
            "manual optimization: the module calls zero_grad, backward, clipping and step "
            "itself, possibly for several optimizers, so .grad when a step returns need not be "
            "the gradient that step used"
        )
    if any(isinstance(opt, torch.optim.LBFGS) for opt in fit.optimizers):
        return (
            "LBFGS evaluates the gradient several times per step; .grad holds the last "
            "evaluation's, not the one its update was made from"
        )
    return None


def _work_dtype(p: torch.Tensor) -> torch.dtype:
    # Differences and directions of half-precision parameters would round to 2⁻⁸..2⁻¹¹.
    return torch.promote_types(p.dtype, torch.float32)


def _cosine(
    a: torch.Tensor, b: torch.Tensor, minus: torch.Tensor, plus: torch.Tensor
) -> torch.Tensor:
    """cos(a, b) from ‖a‖², ‖b‖², ‖a − b‖² and ‖a + b‖² (sums over shards, elementwise for
    per-tensor rows) by the law of cosines, 1 ∓ cos = (‖a ∓ b‖² − (‖a‖ − ‖b‖)²) / 2‖a‖‖b‖ from
    the shorter of a ∓ b: accurate near ±1, unlike a dot product; NaN for a zero vector."""
    na, nb = a.sqrt(), b.sqrt()
    gap, twice = (na - nb).square(), 2 * na * nb
    cosine = torch.where(minus <= plus, 1 - (minus - gap) / twice, (plus - gap) / twice - 1)
    return cosine.clamp(-1, 1)


def _dot_cosine(a: torch.Tensor, b: torch.Tensor, dot: torch.Tensor) -> torch.Tensor:
    """cos(a, b) from ‖a‖², ‖b‖² and ⟨a, b⟩; NaN for a zero vector."""
    return (dot / (a.sqrt() * b.sqrt())).clamp(-1, 1)


def _dots(u: list[torch.Tensor], v: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """⟨uᵢ, vᵢ⟩ per pair of tensors, stacked, as ``dtype``."""
    return torch.stack([p.sum() for p in torch._foreach_mul(u, v)]).to(dtype)


def _squares(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The squared Euclidean norm of each tensor, stacked: one foreach kernel."""
    return torch.stack(torch._foreach_norm(tensors)).to(dtype).square()
