"""How much two k-dimensional subspaces share, and how much of a vector lies in one.

Subspaces are given by orthonormal rows (Ritz vectors, ``(k, n)``), as NumPy arrays or torch
tensors; the results are Python floats computed in float64.
"""

from __future__ import annotations

import math
from typing import Any


def subspace_overlap(a: Any, b: Any) -> float:
    """``‖A Bᵀ‖²_F / k`` for orthonormal rows ``A`` and ``B`` of shape ``(k, n)``.

    The mean squared cosine of the principal angles between the two spans: 1 for the same
    subspace (whatever basis each uses), 0 for orthogonal ones, ``k/n`` on average for random
    ones. For one vector each it is ``cos²`` of the angle between them.

    Example::

        subspace_overlap(vectors_s, vectors_t)  # 1: the same span; 0: orthogonal spans

    Raises:
        ValueError: if the shapes differ or are not two-dimensional.
    """
    if a.ndim != 2 or tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"need two (k, n) bases of one shape, got {a.shape} and {b.shape}")
    products = _float64(a) @ _float64(b).T
    return float((products**2).sum()) / a.shape[0]


def update_share(update: Any, basis: Any) -> float:
    """``‖B u‖² / ‖u‖²``: the share of the squared length of ``update`` inside the span of the
    orthonormal rows ``basis``; NaN for a zero update (no direction to share).

    Example::

        update_share(theta_t1 - theta_t, eigenvectors)  # share of ‖Δθ‖² inside their span
    """
    u = _float64(update)
    if u.shape[-1] != basis.shape[-1]:
        raise ValueError(f"update has length {u.shape[-1]}, basis rows {basis.shape[-1]}")
    total = float((u**2).sum())
    if total == 0:
        return math.nan
    return float(((_float64(basis) @ u) ** 2).sum()) / total


def _float64(array: Any) -> Any:
    # torch tensors and NumPy arrays both have .double() / .astype; keep the library's type.
    return array.double() if hasattr(array, "double") else array.astype("float64")
