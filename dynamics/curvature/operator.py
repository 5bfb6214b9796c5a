"""The Hessian of a scalar loss as a symmetric linear operator on flat parameter vectors.

Every curvature algorithm in this package takes such an operator and nothing else, so each can
be checked against a dense matrix and reused for any loss.

Every product is a reverse pass through one gradient graph built with ``create_graph=True``:
the cheapest of the ways measured (``docs/curvature.md``; ``benchmarks/bench_hessian.py``).
Reusing the graph also fixes one dropout mask and one set of batch statistics for all products,
so the operator is exactly symmetric even for a module in train mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dynamics import world
from dynamics.params.vectors import flatten


class LinearOperator(Protocol):
    """What the algorithms need: a symmetric ``matvec`` on flat vectors of length ``size``,
    returning a new tensor (the algorithms update it in place).

    Example::

        class Dense:
            def __init__(self, matrix):
                self.matrix, self.size = matrix, len(matrix)
                self.dtype, self.device = matrix.dtype, matrix.device

            def matvec(self, vector):
                return self.matrix @ vector

        lanczos(Dense(hessian), k=3)
    """

    @property
    def size(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def matvec(self, vector: torch.Tensor) -> torch.Tensor: ...


class FlatParameterOperator:
    """What every operator on the flat vector of ``params`` shares: its size, dtype and device,
    splitting a vector into the parameters' pieces, one product through a gradient graph, and
    the average over ranks. :class:`HessianOperator` and
    :class:`~dynamics.curvature.MeanHessianOperator` are its two kinds.

    Args:
        params: the tensors (all float32, or all float64, on one device), flattened in order.
        average_across_ranks: average over the ranks of the default ``torch.distributed``
            group whatever :meth:`_mean_over_ranks` is given.
    """

    def __init__(self, params: Sequence[torch.Tensor], average_across_ranks: bool) -> None:
        self.params = list(params)
        _check_params(self.params)
        self._numels = [p.numel() for p in self.params]
        self._world = world.world_size() if average_across_ranks else 1

    @property
    def size(self) -> int:
        return sum(self._numels)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def _chunks(self, vector: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``vector`` (checked to be of the operator's size) split into the parameters' pieces."""
        if vector.shape != (self.size,):
            raise ValueError(
                f"expected a vector of shape ({self.size},), got {tuple(vector.shape)}"
            )
        return torch.split(vector.to(device=self.device, dtype=self.dtype), self._numels)

    def _product(
        self,
        graph: Sequence[torch.Tensor | None],
        chunks: Sequence[torch.Tensor],
        retain_graph: bool,
    ) -> torch.Tensor:
        """The Hessian of the loss whose gradient is ``graph`` times the vector in ``chunks``,
        on this rank alone. A gradient block without a graph (None: the loss is linear in, or
        absent from, that tensor) has zero rows and is left out."""
        live = [i for i, g in enumerate(graph) if g is not None]
        if not live:
            return torch.zeros(self.size, dtype=self.dtype, device=self.device)
        with torch.enable_grad():
            products = torch.autograd.grad(
                [graph[i] for i in live],
                self.params,
                grad_outputs=[chunks[i].view_as(self.params[i]) for i in live],
                retain_graph=retain_graph,
                allow_unused=True,
                materialize_grads=True,
            )
        return flatten(products)

    def _mean_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world == 1:
            return tensor
        # SUM then divide (world.average) works on every backend and gives every rank the same
        # bits, so the ranks' iterations never diverge.
        return world.average(tensor)


class HessianOperator(FlatParameterOperator):
    """Hessian-vector products of ``loss_fn()`` with respect to ``params``.

    The loss and its gradient graph are computed once, in the constructor, under
    :func:`twice_differentiable` (so attention models work); each :meth:`matvec` is one reverse
    pass through that graph. The operator never writes ``.grad``.

    Example::

        operator = HessianOperator(lambda: F.mse_loss(model(x), y), list(model.parameters()))
        product = operator.matvec(torch.randn(operator.size))
        operator.loss, operator.gradient, operator.n_hvp

    Args:
        loss_fn: zero-argument closure returning the scalar loss, computed through ``params``.
        params: the tensors (all float32, or all float64, on one device) the Hessian is taken
            with respect to, flattened in this order.
        average_across_ranks: average the loss, the gradient and every product over the ranks
            of the initialised default ``torch.distributed`` group (the data-parallel Hessian).
            Every rank must then make the same sequence of calls.

    Attributes:
        loss: the loss value (averaged across ranks when asked).
        gradient: the flat gradient, detached (averaged across ranks when asked).
        n_hvp: products computed so far.

    Raises:
        FloatingPointError: if the loss is NaN or infinite (on any rank).
    """

    def __init__(
        self,
        loss_fn: Callable[[], torch.Tensor],
        params: Sequence[torch.Tensor],
        *,
        average_across_ranks: bool = False,
    ) -> None:
        super().__init__(params, average_across_ranks)
        self.n_hvp = 0
        with torch.enable_grad(), twice_differentiable():
            loss = loss_fn()
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError("loss_fn must return a scalar tensor")
            self.loss = self._mean_over_ranks(
                loss.detach().reshape(1).to(self.dtype, copy=True)
            ).item()
            if not math.isfinite(self.loss):
                raise FloatingPointError(f"loss is {self.loss}")
            grads = torch.autograd.grad(
                loss, self.params, create_graph=True, allow_unused=True, materialize_grads=True
            )
        self.gradient = self._mean_over_ranks(flatten(grads))
        self._graph = [g if g.requires_grad else None for g in grads]

    def matvec(self, vector: torch.Tensor) -> torch.Tensor:
        """The product ``H @ vector`` as a flat vector of the operator's dtype."""
        chunks = self._chunks(vector)
        self.n_hvp += 1
        return self._mean_over_ranks(self._product(self._graph, chunks, retain_graph=True))


@contextmanager
def twice_differentiable() -> Iterator[None]:
    """Run a forward whose gradient will itself be differentiated (``create_graph=True``).

    ``F.scaled_dot_product_attention`` picks a fused kernel (flash, memory-efficient, cuDNN)
    when it can; those kernels have a backward but no derivative of it, so the first
    Hessian-vector product through them fails ("derivative for
    aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"). The math
    backend composes ordinary differentiable ops, so attention is forced onto it here; it
    computes the same attention up to rounding, only slower and with more memory.

    Example::

        with twice_differentiable():
            loss = F.cross_entropy(gpt(tokens), targets)  # attention on the math backend
    """
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _check_params(params: list[torch.Tensor]) -> None:
    if not params:
        raise ValueError("params is empty")
    first = params[0]
    for p in params:
        if not p.requires_grad:
            raise ValueError("every tensor in params must require grad")
        if p.dtype not in (torch.float32, torch.float64) or p.dtype != first.dtype:
            raise ValueError(
                f"params must be all float32 or all float64, got {first.dtype} and {p.dtype}"
            )
        if p.device != first.device:
            raise ValueError(f"params must share one device, got {first.device} and {p.device}")
