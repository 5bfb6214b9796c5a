"""The overlap of two runs' top-k Hessian eigenspaces at the steps both stored them.

``HessianSpectrum(vector_budget_mb=...)`` stores the top-k eigenvectors at thinned records; two
runs of one architecture (one parameter layout) can then be asked whether their sharp
directions are the same directions: ``‖V_aᵀ V_b‖²_F / k``
(:mod:`dynamics.geometry.subspace_overlap`),
1 for one subspace, about ``k/n`` for unrelated ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from dynamics.analysis.figures import Curve, line_figure
from dynamics.geometry.subspace_overlap import subspace_overlap
from dynamics.store import Run, names


def eigenspace_overlap(a: Run, b: Run) -> tuple[np.ndarray, np.ndarray] | None:
    """Steps at which both runs stored their top-k eigenvectors, and the overlap at each.

    None when either stored none, when their k differ, or when the parameter layouts differ
    (vectors of different parameters share no coordinates to compare).
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


def eigenspace_overlap_figure(
    runs: Sequence[Run], labels: Sequence[str], colors: Sequence[str]
) -> go.Figure | None:
    """Each run's eigenspace overlap with the first run's at matching steps; None if none."""
    curves = []
    for run, label, color in zip(runs[1:], labels[1:], colors[1:]):
        overlap = eigenspace_overlap(runs[0], run)
        if overlap is not None:
            curves.append(Curve(f"{label} vs {labels[0]}", *overlap, color, markers=True))
    if not curves:
        return None
    return line_figure(
        curves,
        title="Overlap of the runs' top-k Hessian eigenspaces at matching steps",
        y_title="‖V_aᵀ V_b‖²_F / k",
    )
