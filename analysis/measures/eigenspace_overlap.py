"""The overlap of two runs' top-k Hessian eigenspaces at the steps both stored them.

``HessianSpectrum(vector_budget_mb=...)`` stores the top-k eigenvectors at thinned records; two
runs of one architecture (one parameter layout) can then be asked whether their sharp
directions are the same directions: ``‖V_aᵀ V_b‖²_F / k``
(:mod:`dynamics.geometry.subspace_overlap`),
1 for one subspace, about ``k/n`` for unrelated ones. Drawn by
:mod:`dynamics.analysis.figures.eigenspace_overlap`.
"""

from __future__ import annotations

import numpy as np

from dynamics.geometry.subspace_overlap import subspace_overlap
from dynamics.store import Run, names


def eigenspace_overlap(a: Run, b: Run) -> tuple[np.ndarray, np.ndarray] | None:
    """Steps at which both runs stored their top-k eigenvectors, and the overlap at each.

    None when either stored none, when their k differ, or when the parameter layouts differ
    (vectors of different parameters share no coordinates to compare).

    Example::

        steps, overlap = eigenspace_overlap(open_run("runs/a.h5"), open_run("runs/b.h5"))
    """
    # The stored layouts as text: Run.layout would import torch, which offline views never do.
    layout = a.attrs.get(names.ATTR_LAYOUT)
    if layout is None or layout != b.attrs.get(names.ATTR_LAYOUT):
        return None
    stored = [run.recorded(names.HESSIAN_VECTORS) for run in (a, b)]
    if any(rows is None for rows in stored):
        return None
    (sa, va), (sb, vb) = ((rows.step, rows[names.HESSIAN_VECTORS_RITZ]) for rows in stored)
    if va.shape[1:] != vb.shape[1:]:
        return None
    steps, ia, ib = np.intersect1d(sa, sb, return_indices=True)
    if not len(steps):
        return None
    return steps, np.array([subspace_overlap(va[i], vb[j]) for i, j in zip(ia, ib)])
