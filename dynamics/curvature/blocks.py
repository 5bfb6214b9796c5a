"""A diagonal block ``H_bb`` of an operator: the operator restricted to some coordinates.

For a set ``b`` of coordinates of the flat parameter vector (a layer's parameters, an optimizer's
parameter group), ``H_bb`` is ``H`` with rows and columns outside ``b`` dropped. Its product
with a vector ``v`` of length ``|b|`` is ``(H E_b v)_b``, where ``E_b`` embeds ``v`` into a zero
vector of the operator's size: one product of ``H`` per product of ``H_bb``. The block is itself
a :class:`~dynamics.curvature.operator.LinearOperator`, so every algorithm of this package
(Lanczos, Hutchinson, Hutch++, stochastic Lanczos quadrature) runs on it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dynamics.curvature.operator import LinearOperator
from dynamics.params.layout import ParameterLayout

#: A block's coordinates in the flat layout: a contiguous range, or increasing indices.
Coordinates = slice | torch.Tensor


class BlockOperator:
    """The diagonal block of ``operator`` on ``coordinates``, as a symmetric linear operator.

    Example::

        operator = HessianOperator(loss_fn, params)
        block = BlockOperator(operator, slice(0, 24))  # the first layer's weight
        lanczos(block, k=3).eigenvalues  # the top eigenvalues of H_bb
        hutchinson(block, n_hvp=50).trace  # an estimate of tr H_bb

    Args:
        operator: the whole operator (e.g. a :class:`~dynamics.curvature.HessianOperator`);
            each product of the block is one of its products (its ``n_hvp`` counts them).
        coordinates: a ``slice`` with step 1 within ``range(operator.size)``, or a 1-D tensor of
            distinct indices into it (the block's coordinates, in that order).

    Raises:
        ValueError: an empty block, a slice with a step or out of range, indices repeated or
            out of range.
    """

    def __init__(self, operator: LinearOperator, coordinates: Coordinates) -> None:
        self.operator = operator
        self.coordinates = _checked(coordinates, operator.size)
        if isinstance(self.coordinates, slice):
            self._size = self.coordinates.stop - self.coordinates.start
        else:
            self._size = len(self.coordinates)
            self._index = self.coordinates.to(operator.device)

    @property
    def size(self) -> int:
        return self._size

    @property
    def dtype(self) -> torch.dtype:
        return self.operator.dtype

    @property
    def device(self) -> torch.device:
        return self.operator.device

    def matvec(self, vector: torch.Tensor) -> torch.Tensor:
        """``H_bb @ vector``: ``vector`` embedded by zeros, one product of the whole operator,
        the block's coordinates of it."""
        if vector.shape != (self.size,):
            raise ValueError(
                f"expected a vector of shape ({self.size},), got {tuple(vector.shape)}"
            )
        return self.restrict(self.operator.matvec(self.embed(vector)))

    def embed(self, vector: torch.Tensor) -> torch.Tensor:
        """The whole-size vector equal to ``vector`` on the block and zero elsewhere."""
        whole = torch.zeros(self.operator.size, dtype=self.dtype, device=self.device)
        if isinstance(self.coordinates, slice):
            whole[self.coordinates] = vector
        else:
            whole[self._index] = vector.to(device=self.device, dtype=self.dtype)
        return whole

    def restrict(self, vector: torch.Tensor) -> torch.Tensor:
        """The block's coordinates of a whole-size ``vector`` (a new tensor)."""
        if isinstance(self.coordinates, slice):
            return vector[self.coordinates].clone()
        return vector[self._index]


def layout_coordinates(layout: ParameterLayout, parameters: Sequence[str]) -> Coordinates:
    """The coordinates of the named ``parameters`` in ``layout``'s flat vector: a slice when
    they are consecutive in it, else the indices in increasing order.

    Example::

        layout_coordinates(ParameterLayout.of(model), ["fc1.weight", "fc1.bias"])  # slice(0, 30)

    Raises:
        ValueError: no parameters, a name not in the layout, or a name given twice.
    """
    if not parameters:
        raise ValueError("a block needs at least one parameter")
    if len(set(parameters)) != len(parameters):
        raise ValueError(f"a block names a parameter twice: {list(parameters)}")
    position = {name: i for i, name in enumerate(layout.names)}
    missing = [name for name in parameters if name not in position]
    if missing:
        raise ValueError(f"no parameter {missing[0]!r} in the layout")
    offsets = [0]
    for numel in layout.numels:
        offsets.append(offsets[-1] + numel)
    members = sorted(position[name] for name in parameters)
    if members == list(range(members[0], members[-1] + 1)):
        return slice(offsets[members[0]], offsets[members[-1] + 1])
    return torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in members])


def _checked(coordinates: Coordinates, size: int) -> Coordinates:
    if isinstance(coordinates, slice):
        start, stop, step = coordinates.indices(size)
        if step != 1 or coordinates.step not in (None, 1):
            raise ValueError(f"a block slice takes no step, got {coordinates}")
        if coordinates.start is not None and not 0 <= coordinates.start <= size:
            raise ValueError(f"block {coordinates} lies outside range({size})")
        if coordinates.stop is not None and not 0 <= coordinates.stop <= size:
            raise ValueError(f"block {coordinates} lies outside range({size})")
        if stop <= start:
            raise ValueError(f"block {coordinates} is empty")
        return slice(start, stop)
    index = torch.as_tensor(coordinates, dtype=torch.int64).reshape(-1)
    if not len(index):
        raise ValueError("a block needs at least one coordinate")
    if index.min() < 0 or index.max() >= size:
        raise ValueError(f"block indices lie outside range({size})")
    if len(torch.unique(index)) != len(index):
        raise ValueError("block indices repeat a coordinate")
    return index
