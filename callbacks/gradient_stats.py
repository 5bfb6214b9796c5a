"""Gradient norms per tensor, before and after clipping, and the gradient noise scale."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dynamics import world
from dynamics.callbacks.fit import Fit
from dynamics.callbacks.probe import Probe, ProbeUnavailable, Rows, SeriesSpec, parameter_shards
from dynamics.callbacks.trajectory_geometry import GRADIENT_DEFINITION
from dynamics.params.naming import named_parameters
from dynamics.passes.isolation import in_extra_pass
from dynamics.store import View, names

#: How the norms are drawn (declared with them).
NORM_VIEWS = {
    names.GRADIENT_NORM: View("scalar", "Gradient norm after clipping ‖g‖", "‖g‖", log_y=True),
    names.GRADIENT_NORM_PER_TENSOR: View(
        "lines", "Gradient norm per tensor after clipping ‖g_i‖", "‖g_i‖", log_y=True
    ),
}
#: How the series that need the gradient before clipping are drawn.
BEFORE_CLIP_VIEWS = {
    names.GRADIENT_NORM_BEFORE_CLIP: View(
        "scalar", "Gradient norm before clipping ‖g‖", "‖g‖", log_y=True
    ),
}
#: How the noise scale and its parts are drawn: on linear axes, since each estimate of a
#: step may come out negative.
NOISE_VIEWS = {
    names.GRADIENT_NOISE_SCALE: View(
        "scalar", "Gradient noise scale B_simple = tr Σ / ‖G‖²", "B_simple", units="samples"
    ),
    names.GRADIENT_SQUARED_NORM: View(
        "scalar", "Squared norm of the true gradient ‖G‖² (estimate)", "‖G‖²"
    ),
    names.GRADIENT_TRACE_COVARIANCE: View(
        "scalar", "Per-sample gradient variance tr Σ (estimate)", "tr Σ"
    ),
    names.GRADIENT_BATCH_SMALL: View(
        "scalar", "B_small of the noise scale", "B_small", units="samples"
    ),
    names.GRADIENT_BATCH_BIG: View("scalar", "B_big of the noise scale", "B_big", units="samples"),
}

#: How the noise scale is estimated, stored with the probe's settings.
NOISE_DEFINITION = (
    "B_simple = tr Σ / ‖G‖² from the unbiased estimators of McCandlish et al. 2018, Appendix A, "
    "at two batch sizes: each micro-batch's gradient G_j (its contribution to .grad times "
    "accumulate_grad_batches k, so that their mean is the accumulated gradient) at B_small, and "
    "the accumulated gradient before clipping at B_big; 1/B_small is the mean of the "
    "micro-batches' 1/b_j and B_big = k·B_small (the variance of a mean of k micro-batch means). "
    "With A = mean_j ‖G_j‖² and C = ‖Σ_j G_j / k‖²: ‖G‖² = (k·C − A)/(k − 1) and "
    "tr Σ = B_small·(A − C)/(1 − 1/k). Assumes each micro-batch's loss is a mean over its b_j "
    "samples; its scale cancels in B_simple"
)
#: How the noise scale is estimated under DDP, stored with the probe's settings.
PER_RANK_NOISE_DEFINITION = (
    "B_simple = tr Σ / ‖G‖² from the unbiased estimators of McCandlish et al. 2018, Appendix A, "
    "at two batch sizes: each rank's gradient of each micro-batch G_rj (the gradient a tensor "
    "hook on each parameter receives from that micro-batch's backward, before it is accumulated "
    "into .grad and before DDP averages it over the R ranks, times accumulate_grad_batches k) at "
    "B_small, and the all-reduced accumulated gradient before clipping at B_big; with n = R·k, "
    "1/B_small is the mean of the n micro-batches' 1/b_rj and B_big = n·B_small. With "
    "A = mean_rj ‖G_rj‖² (summed over the ranks in one all-reduce of three scalars) and "
    "C = ‖Σ_rj G_rj / n‖²: ‖G‖² = (n·C − A)/(n − 1) and tr Σ = B_small·(A − C)/(1 − 1/n). "
    "Assumes each micro-batch's loss is a mean over its b_rj samples; its scale cancels in "
    "B_simple"
)


def first_dimension(batch: Any) -> int:
    """The batch size by the default rule: the first dimension of the batch's first tensor
    (a mapping's values in order, a list's or tuple's items in order, depth first).

    Example::

        first_dimension({"input_ids": torch.zeros(8, 128, dtype=torch.long)})  # 8

    Raises:
        ProbeUnavailable: the batch holds no tensor with a dimension.
    """
    tensor = _first_tensor(batch)
    if tensor is None or tensor.ndim == 0:
        raise ProbeUnavailable(
            "GradientStats: the batch holds no tensor with a first dimension to take its size "
            "from; pass batch_size="
        )
    return tensor.shape[0]


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if (found := _first_tensor(item)) is not None:
                return found
    return None


class GradientStats(Probe):
    """Gradient norms per tensor and in total, before and after clipping, and the gradient
    noise scale B_simple from the micro-batches of gradient accumulation or, under DDP, from
    each rank's micro-batches (read by tensor hooks before DDP averages them).

    What it records, cost, when it steps aside and pitfalls: ``docs/probes/gradient_stats.md``.

    Example::

        GradientStats()  # with Trainer(accumulate_grad_batches=4) for the noise scale
        GradientStats(batch_size=lambda batch: batch["attention_mask"].sum())  # tokens

    Args:
        every_n_steps: period of the rows in optimizer steps.
        batch_size: a micro-batch's size in samples, from the batch (an int, or a scalar
            tensor left on the device); default :func:`first_dimension`.
    """

    name = names.GRADIENT_STATS

    def __init__(
        self,
        every_n_steps: int = 1,
        batch_size: Callable[[Any], int | torch.Tensor] = first_dimension,
    ) -> None:
        super().__init__(every_n_steps)
        self.batch_size = batch_size
        self.noise_problem: str | None = None  # why the noise scale is not measured, at setup
        self.before_clip_problem: str | None = None  # why the norm before clipping is not
        self._tensor_names: list[str] = []
        self._params: list[nn.Parameter] = []  # the parameters the optimizers hold
        self._accumulation = 1
        self._dtype = torch.float64  # the sums' dtype (MPS has no float64)
        self._device = torch.device("cpu")
        self._previous: list[torch.Tensor] = []  # .grad after the last micro-batch, k > 1
        self._small: torch.Tensor | float = 0.0  # Σ_j ‖G_j‖², this step
        self._inverse_sizes: torch.Tensor | float = 0.0  # Σ_j 1/b_j, this step
        self._micro_batches = 0  # counted this step
        self._before: torch.Tensor | None = None  # ‖g‖² before clipping, this step
        self._after: torch.Tensor | None = None  # ‖g_i‖² when the optimizer stepped, this step
        self._hooks: list[Any] = []  # on the optimizers' steps and, under DDP, the parameters
        self._armed = False
        self._per_rank = False  # under DDP: the noise scale from each rank's local gradients
        self._collecting = False  # every rank, at a due step under DDP
        self._local: list[torch.Tensor] = []  # ‖g‖² per tensor hook call, this micro-batch
        self._noted: set[str] = set()

    def setup(self, fit: Fit, module: nn.Module, batch: Any) -> None:
        problem = _gradient_problem(fit, module)
        if problem is not None:
            raise ProbeUnavailable(f"GradientStats: {problem}")
        if parameter_shards(fit, module).sharded:
            raise ProbeUnavailable(
                "GradientStats: the parameters are sharded, and .grad holds this rank's part only"
            )
        held = {id(p) for opt in fit.optimizers for g in opt.param_groups for p in g["params"]}
        found = [(n, p) for n, p in named_parameters(module) if id(p) in held]
        if not found:
            raise ProbeUnavailable("GradientStats: no optimizer holds a parameter of the module")
        self._tensor_names = [n for n, _ in found]
        self._params = [p for _, p in found]
        self._device = self._params[0].device
        self._dtype = torch.float32 if self._device.type == "mps" else torch.float64
        self._accumulation = fit.accumulate_grad_batches
        self.before_clip_problem = self.noise_problem = None
        if not getattr(fit, "calls_before_optimizer_step", False):
            self.before_clip_problem = (
                f"the {fit.loop} loop has no point between the last backward and gradient clipping"
            )
            self.noise_problem = self.before_clip_problem
        elif fit.precision in ("16-mixed", "16"):
            # A gradient scaler unscales .grad once, before the step: the micro-batches before
            # the last are still scaled (by a factor only a host sync would read).
            self.noise_problem = (
                "under 16-mixed precision the micro-batches' gradients before the last are "
                "still multiplied by the gradient scaler's scale"
            )
        elif fit.world_size > 1:
            # DDP all-reduces .grad in the last micro-batch's backward; a tensor hook receives
            # each backward's local gradient before it is accumulated and reduced.
            self._per_rank = True
        elif self._accumulation == 1:
            self.noise_problem = (
                "one micro-batch per step on one process: B_small = B_big, so B_simple cannot "
                "be estimated (use accumulate_grad_batches >= 2)"
            )
        for what, problem in (
            (names.GRADIENT_NORM_BEFORE_CLIP, self.before_clip_problem),
            (names.GRADIENT_NOISE_SCALE, self.noise_problem),
        ):
            if problem:
                self._note_once(fit.global_step, f"{what} not recorded: {problem}")
        if self._per_rank:  # a hook runs once per backward, with the summed uses' gradient
            self._hooks = [p.register_hook(self._received) for p in self._params]
        elif self.noise_problem is None:  # one copy of the gradients, to difference them
            self._previous = [torch.zeros_like(p) for p in self._params]
        # When the optimizer's step returns, .grad is what it was handed, in every loop; a plain
        # loop's zero_grad may follow before the step ends.
        self._hooks += [opt.register_step_post_hook(self._stepped) for opt in fit.optimizers]

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        shape, columns = (len(self._tensor_names),), tuple(self._tensor_names)
        series = {
            names.GRADIENT_NORM: SeriesSpec(view=NORM_VIEWS[names.GRADIENT_NORM]),
            names.GRADIENT_NORM_PER_TENSOR: SeriesSpec(
                shape, columns=columns, view=NORM_VIEWS[names.GRADIENT_NORM_PER_TENSOR]
            ),
        }
        if self.before_clip_problem is None:
            series |= {name: SeriesSpec(view=view) for name, view in BEFORE_CLIP_VIEWS.items()}
        if self.noise_problem is None:
            series |= {name: SeriesSpec(view=view) for name, view in NOISE_VIEWS.items()}
        return {names.GRADIENT_STATS: series}

    def settings(self) -> dict[str, Any]:
        return {
            "gradient": GRADIENT_DEFINITION,
            "norm_before_clip": (
                f"not measured: {self.before_clip_problem}"
                if self.before_clip_problem
                else "after the last backward and AMP unscaling, before gradient clipping"
            ),
            "noise_scale": (
                f"not measured: {self.noise_problem}"
                if self.noise_problem
                else PER_RANK_NOISE_DEFINITION
                if self._per_rank
                else NOISE_DEFINITION
            ),
            "batch_size": getattr(self.batch_size, "__name__", repr(self.batch_size)),
        }

    def on_step_start(self, fit: Fit, module: nn.Module, batch: Any, step: int) -> None:
        # Unsharded, the ranks' gradients agree once reduced: only rank zero, which writes, works.
        self._armed = fit.is_global_zero
        self._before = self._after = None
        self._small, self._inverse_sizes, self._micro_batches = 0.0, 0.0, 0
        self._collecting = self._per_rank  # every rank's local gradients count
        self._local = []
        if self._armed and self._previous:
            torch._foreach_zero_(self._previous)  # .grad still holds the last step's gradient

    def on_micro_batch_end(
        self, fit: Fit, module: nn.Module, batch: Any, outputs: Any, step: int
    ) -> None:
        if not (self._armed or self._collecting) or self.noise_problem:
            return
        self._inverse_sizes = self._inverse_sizes + 1.0 / self.batch_size(batch)
        self._micro_batches += 1
        if self._per_rank:  # G_rj = k·(this backward's local gradient)
            if self._local:
                square = torch.stack(self._local).sum() * self._accumulation**2
                self._small = self._small + square
            self._local = []
        elif self._before is None:  # not the last micro-batch: the optimizer has not stepped
            self._small = self._small + self._contribution()

    def on_before_optimizer_step(self, fit: Fit, module: nn.Module, step: int) -> None:
        if not self._armed:
            return
        self._before = _squares(self._grads(), self._dtype).sum()
        if self.noise_problem is None and not self._per_rank:
            self._small = self._small + self._contribution()

    def on_step_end(self, fit: Fit, module: nn.Module, batch: Any, outputs: Any, step: int) -> Rows:
        totals = self._rank_totals(fit) if self._collecting else None
        if not self._armed:
            return {}
        self._armed = False
        squares = self._after
        if squares is None:
            self._note_once(
                step,
                "a step without an optimizer step (a gradient scaler skipped it): its norms "
                "are NaN",
            )
            squares = torch.full(
                (len(self._params),), math.nan, dtype=self._dtype, device=self._device
            )
        rows: dict[str, Any] = {
            names.GRADIENT_NORM: squares.sum().sqrt(),
            names.GRADIENT_NORM_PER_TENSOR: squares.sqrt(),
        }
        if self.before_clip_problem is None:
            before = self._before
            if before is None:  # e.g. a step a gradient scaler skipped before the hook
                before = torch.full((), math.nan, dtype=self._dtype, device=self._device)
            rows[names.GRADIENT_NORM_BEFORE_CLIP] = before.sqrt()
        if totals is not None:
            rows |= self._noise(step, *totals)
        elif self.noise_problem is None:
            rows |= self._noise(step, self._small, self._inverse_sizes, self._accumulation)
        return {names.GRADIENT_STATS: rows}

    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._params, self._previous = [], [], []
        self._before = self._after = None
        self._armed = self._collecting = False
        self._local = []

    def _received(self, grad: torch.Tensor) -> None:
        """A tensor hook: ‖g‖² of the gradient this backward sends into a parameter's .grad,
        this rank's alone (DDP reduces after accumulation). None: the gradient is unchanged."""
        if self._collecting and not in_extra_pass():  # other probes' autograd.grad passes too
            self._local.append(torch.linalg.vector_norm(grad).to(self._dtype).square())

    def _rank_totals(self, fit: Fit) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """Σ ‖G_rj‖², Σ 1/b_rj and the count of micro-batches over every rank (one all-reduce
        of three scalars, on every rank), with the count a full step has, R·k."""
        self._collecting = False
        if self._micro_batches != self._accumulation:
            self._note_once(
                fit.global_step,
                f"a step of {self._micro_batches} micro-batches, not {self._accumulation}, on "
                "a rank: its noise scale is NaN",
            )
        scalars = [
            torch.as_tensor(value, dtype=self._dtype, device=self._device)
            for value in (self._small, self._inverse_sizes, self._micro_batches)
        ]
        small, inverse, count = world.all_reduce(scalars)
        return small, inverse, fit.world_size * self._accumulation, count

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._armed:
            self._after = _squares(self._grads(), self._dtype)

    def _grads(self) -> list[torch.Tensor]:
        """The gradients the optimizers are handed; zeros for a parameter without one."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]

    def _contribution(self) -> torch.Tensor:
        """‖G_j‖² of the micro-batch whose backward just ended, G_j = k·(.grad − the copy);
        the copy then takes .grad."""
        grads = self._grads()
        torch._foreach_sub_(self._previous, grads)  # −(this micro-batch's contribution)
        square = _squares(self._previous, self._dtype).sum() * self._accumulation**2
        torch._foreach_copy_(self._previous, grads)
        return square

    def _noise(
        self,
        step: int,
        small_sum: torch.Tensor | float,
        inverse_sum: torch.Tensor | float,
        k: int,
        count: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The estimates from k small batches (k = R·k under DDP, whose ``count`` over the
        ranks makes a step with another count NaN on the device, without a host sync)."""
        one = torch.ones((), dtype=self._dtype, device=self._device)
        if self._before is None or (count is None and self._micro_batches != k):
            self._note_once(
                step,
                f"a step of {self._micro_batches} micro-batches, not {self._accumulation}, or "
                "without the hook before clipping: its noise scale is NaN",
            )
            return {name: one * math.nan for name in NOISE_VIEWS}
        small = small_sum / k  # A = mean_j ‖G_j‖²
        big = self._before  # C = ‖mean_j G_j‖²
        inverse = inverse_sum / k  # mean_j 1/b_j = 1/B_small
        trace = (small - big) / (inverse * (1 - 1 / k))
        squared = (k * big - small) / (k - 1)
        rows = {
            names.GRADIENT_NOISE_SCALE: trace / squared,
            names.GRADIENT_SQUARED_NORM: squared,
            names.GRADIENT_TRACE_COVARIANCE: trace,
            names.GRADIENT_BATCH_SMALL: one / inverse,
            names.GRADIENT_BATCH_BIG: one * k / inverse,
        }
        if count is not None:  # a rank's step of another count: NaN
            rows = {name: torch.where(count == k, v, math.nan) for name, v in rows.items()}
        return rows

    def _note_once(self, step: int, message: str) -> None:
        if message not in self._noted:
            self._noted.add(message)
            self.note(step, message)


def _gradient_problem(fit: Fit, module: nn.Module) -> str | None:
    """Why .grad at the optimizer step is not the gradient of the step's update, or None."""
    if not getattr(module, "automatic_optimization", True):  # a LightningModule's flag
        return (
            "manual optimization: the module calls zero_grad, backward, clipping and step "
            "itself, possibly for several optimizers"
        )
    if any(isinstance(opt, torch.optim.LBFGS) for opt in fit.optimizers):
        return "LBFGS evaluates the gradient several times per step"
    return None


def _squares(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The squared Euclidean norm of each tensor, stacked: one foreach kernel."""
    return torch.stack(torch._foreach_norm(tensors)).to(dtype).square()
