"""How the standard probes' series are drawn: their declarations, and the views of run files
written before series stored them.

The standard probes declare their series with the views of this table (a user's probe declares
its own), and the writer stores each as the series' ``view`` attribute. A file without any such
attribute was written before views existed; its reader takes the views from this same table,
keyed by the names of :mod:`dynamics.store.names`, so old and new files draw alike.
"""

from __future__ import annotations

from dynamics.store import names
from dynamics.store.schema import View

#: ``{group: {series: View}}`` of the standard probes; every logged validation metric (any
#: name) is drawn by :func:`validation_view`.
STANDARD_VIEWS: dict[str, dict[str, View]] = {
    names.LOSS: {names.LOSS_TRAIN: View("scalar", "Training loss", "loss", log_y=True)},
    names.HIDDEN_NORMS: {
        names.HIDDEN_NORM: View("panels", "Hidden-state norm per layer", "mean ‖h‖"),
    },
    names.ACTIVATION_BIAS: {
        names.ACTIVATION_MEAN: View(
            "panels", "Activation bias per layer (mean post-activation)", "mean φ(z)"
        ),
    },
    names.DISPLACEMENT: {
        names.DISPLACEMENT_TOTAL: View("scalar", "Distance from initialization", "‖θt − θ0‖"),
        names.DISPLACEMENT_PER_TENSOR: View(
            "lines", "Distance from initialization per tensor", "‖θt − θ0‖"
        ),
        names.DISPLACEMENT_UPDATE: View("scalar", "Update size", "‖θt+1 − θt‖", log_y=True),
    },
    names.HESSIAN: {
        names.HESSIAN_EIGENVALUES: View("lines", "Top Hessian eigenvalues", "λ"),
        names.HESSIAN_RESIDUALS: View(
            "lines", "Eigenpair residuals ‖Hv − λv‖", "residual", log_y=True
        ),
        names.HESSIAN_N_HVP: View("scalar", "Hessian-vector products per record", "HVPs"),
        names.HESSIAN_LOSS: View("scalar", "Probe-batch loss", "loss"),
        names.HESSIAN_TRACE: View("scalar", "Hessian trace (Hutch++)", "tr H"),
        names.HESSIAN_GRADIENT_SHARE: View(
            "scalar", "Gradient share in the top-k eigenspace", "‖P_k g‖² / ‖g‖²"
        ),
        names.HESSIAN_OVERLAP: View(
            "scalar", "Top-k eigenspace overlap with the previous record", "‖V_sᵀ V_t‖²_F / k"
        ),
        names.HESSIAN_UPDATE_SHARE: View(
            "scalar",
            "Share of the update since the previous record in that record's top-k eigenspace",
            "‖P_k(θt − θs)‖² / ‖θt − θs‖²",
        ),
        names.HESSIAN_BATCH_RAYLEIGH: View(
            "lines", "Curvature along v₁ on each probe-set batch", "v₁ᵀ H_i v₁"
        ),
        names.HESSIAN_BATCH_RAYLEIGH_STD: View(
            "scalar", "Spread of v₁ᵀ H_i v₁ over the probe-set batches", "std over batches"
        ),
    },
    names.HESSIAN_BLOCKS: {
        names.HESSIAN_BLOCKS_LAMBDA_MAX: View(
            "lines", "Top eigenvalue of each Hessian block H_bb", "λ1(H_bb)"
        ),
        names.HESSIAN_BLOCKS_TRACE: View("lines", "Trace of each Hessian block H_bb", "tr H_bb"),
    },
}


def validation_view(key: str) -> View:
    """The view of a metric logged during validation under ``key``."""
    return View("scalar", f"Validation: {key}", key)


def standard_view(group: str, name: str) -> View | None:
    """The view of a standard probe's series, or None for a series that is not drawn."""
    if group == names.VALIDATION:
        return validation_view(name)
    return STANDARD_VIEWS.get(group, {}).get(name)
