"""The Hessian of the mean loss over a set of batches, as one operator on flat parameter vectors.

A spectrum measured on one small batch is that batch's, not the data's; the mean of the batches'
losses, L = (1/N) Σ_i L_i, has the Hessian H = (1/N) Σ_i H_i, whose products are the mean of
the batches' products. Every algorithm that takes a :class:`~dynamics.curvature.LinearOperator`
takes this one unchanged.

Two ways to hold the N gradient graphs, chosen by ``keep_graphs`` (measured by
``benchmarks/bench_hessian_probe_set.py``):

- kept (default): each batch's loss is differentiated once with ``create_graph=True`` and its
  graph lives as long as the operator: N times the activation memory of one batch, and a product
  is N reverse passes through those graphs (the cost of one product on N times the data).
- recomputed: nothing is held between products; each product rebuilds every batch's gradient
  graph in turn (a forward and a backward per batch) and frees it: one batch's activation
  memory, and a product costs N forwards, backwards and double backwards. Deterministic
  losses only: a train-mode module would draw a new dropout mask at each rebuild, and the
  products would not be those of one symmetric matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from dynamics.curvature.operator import FlatParameterOperator, twice_differentiable
from dynamics.params.vectors import flatten


class MeanHessianOperator(FlatParameterOperator):
    """Hessian-vector products of the mean of ``loss_fns``' losses, with respect to ``params``.

    Each batch weighs the same (1/N), whatever its size: each ``loss_fn`` is already its own
    batch's mean (over examples, or over tokens for a token-averaged language-model loss), and
    for batches of one size this is the mean over all their examples. The operator never
    writes ``.grad``.

    Example::

        fns = [lambda x=x, y=y: F.mse_loss(model(x), y) for x, y in batches]
        operator = MeanHessianOperator(fns, list(model.parameters()))
        operator.matvec(v)  # (1/N) Σ_i H_i v
        operator.batch_matvec(0, v)  # H_0 v, the first batch's own Hessian

    Args:
        loss_fns: zero-argument closures, one per batch, each returning its scalar loss
            computed through ``params``.
        params: the tensors (all float32, or all float64, on one device) the Hessian is taken
            with respect to, flattened in this order.
        average_across_ranks: average the loss, the gradient and every product over the ranks
            of the initialised default ``torch.distributed`` group (each rank's set its own);
            every rank must then make the same sequence of calls.
        keep_graphs: hold every batch's gradient graph (N× activation memory, N reverse passes
            a product) or rebuild each one at each product (1× memory, N forward and backward
            passes more a product; deterministic losses only).

    Attributes:
        loss: the mean loss over the set (averaged across ranks when asked).
        losses: each batch's loss (averaged across ranks when asked), as a list of floats.
        gradient: the flat gradient of the mean loss, detached.
        n_hvp: products of the set's operator computed so far (each is N batch products).
        n_batch_hvp: single-batch products (:meth:`batch_matvec`) computed so far.

    Raises:
        FloatingPointError: if any batch's loss is NaN or infinite (on any rank).
        ValueError: if ``loss_fns`` is empty.
    """

    def __init__(
        self,
        loss_fns: Sequence[Callable[[], torch.Tensor]],
        params: Sequence[torch.Tensor],
        *,
        average_across_ranks: bool = False,
        keep_graphs: bool = True,
    ) -> None:
        if not loss_fns:
            raise ValueError("loss_fns is empty")
        super().__init__(params, average_across_ranks)
        self._fns = list(loss_fns)
        self.keep_graphs = keep_graphs
        self.n_hvp = 0
        self.n_batch_hvp = 0
        self._graphs: list[list[torch.Tensor | None]] = []
        losses, gradients = [], []
        for fn in self._fns:
            loss, grads = self._gradient_graph(fn, create_graph=keep_graphs)
            losses.append(loss.detach().reshape(1).to(self.dtype, copy=True))
            gradients.append(flatten([g.detach() for g in grads]))
            if keep_graphs:
                self._graphs.append([g if g.requires_grad else None for g in grads])
        # Checked once averaged, so every rank raises together and none waits on a collective.
        per_batch = self._mean_over_ranks(torch.cat(losses))
        self.losses = per_batch.tolist()
        if not all(math.isfinite(value) for value in self.losses):
            raise FloatingPointError(f"a batch's loss is not finite: {self.losses}")
        self.loss = float(per_batch.mean())
        self.gradient = self._mean_over_ranks(torch.stack(gradients).mean(0))

    @property
    def n_batches(self) -> int:
        return len(self._fns)

    def matvec(self, vector: torch.Tensor) -> torch.Tensor:
        """The product ``H @ vector`` of the mean loss's Hessian, ``(1/N) Σ_i H_i @ vector``."""
        chunks = self._chunks(vector)
        self.n_hvp += 1
        total = torch.zeros(self.size, dtype=self.dtype, device=self.device)
        for i in range(self.n_batches):
            total += self._batch_product(i, chunks)
        return self._mean_over_ranks(total / self.n_batches)

    def batch_matvec(self, index: int, vector: torch.Tensor) -> torch.Tensor:
        """The product ``H_index @ vector`` of one batch's own loss (averaged across ranks as
        :meth:`matvec` is: the Hessian of the mean over ranks of their ``index``-th batch)."""
        chunks = self._chunks(vector)
        self.n_batch_hvp += 1
        return self._mean_over_ranks(self._batch_product(index, chunks))

    def _gradient_graph(
        self, fn: Callable[[], torch.Tensor], *, create_graph: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        with torch.enable_grad(), twice_differentiable():
            loss = fn()
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError("each loss_fn must return a scalar tensor")
            grads = torch.autograd.grad(
                loss,
                self.params,
                create_graph=create_graph,
                allow_unused=True,
                materialize_grads=True,
            )
        return loss, grads

    def _batch_product(self, index: int, chunks: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``H_index`` times the vector split into ``chunks``, on this rank alone."""
        if self.keep_graphs:
            graph = self._graphs[index]
        else:
            _, grads = self._gradient_graph(self._fns[index], create_graph=True)
            graph = [g if g.requires_grad else None for g in grads]
        return self._product(graph, chunks, retain_graph=self.keep_graphs)
