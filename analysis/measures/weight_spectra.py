"""Weight spectra over training, offline from the states a run stored: for each weight matrix
W of θt and its displacement ΔW = Wt − W0, the spectral norm ‖W‖₂, the Frobenius norm ‖W‖_F,
the stable rank ‖W‖²_F / ‖W‖²₂, and the power-law exponent α of the eigenvalue density of WᵀW,
fitted as WeightWatcher does.

Which tensors: every parameter with two or more dimensions (linear layers, embeddings,
convolutions); vectors (biases, norms' gains) are not matrices. A tensor of shape
``(out, in, k1, ...)`` is read as the ``(out, in·k1·…)`` matrix (a convolution's output channels
against its receptive field); WeightWatcher instead pools the eigenvalues of the ``k1·…``
``(out, in)`` slices of a convolution, so a convolution's α differs from its (a dense layer's
agrees).

The fit (WeightWatcher's default ``pl_package="ww"``, which follows the ``powerlaw`` package's
continuous fit with Clauset, Shalizi & Newman 2009's choice of x_min): the eigenvalues λ = σ²
of WᵀW, unnormalized (WeightWatcher's ``normalize=False``: α does not depend on the scale, x_min
does), keep those above 1e-5; every one but the largest is a candidate x_min; for each, the
continuous maximum-likelihood α = 1 + n / Σ ln(λᵢ / x_min) over the n eigenvalues ≥ x_min, and
the Kolmogorov–Smirnov distance D = max |1 − (λ/x_min)^(1−α) − F_n(λ)| between the fitted CDF and
the empirical one F_n (i/n at the i-th of them, from 0); x_min is the candidate of least D (among
those with α > 1). No x_max (WeightWatcher's default). A matrix whose smaller side is under 8
(WeightWatcher's ``min_evals``) gets no α.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from dynamics.errors import DynamicsError
from dynamics.store import Run, names

__all__ = [
    "EIGENVALUE_THRESHOLD",
    "METRICS",
    "MIN_EIGENVALUES",
    "MatrixSpectrum",
    "PowerLawFit",
    "WeightSpectra",
    "fit_power_law",
    "matrix_spectrum",
    "weight_matrix",
    "weight_spectra",
]

#: Eigenvalues of WᵀW at or below this are left out of the fit (WeightWatcher's EVALS_THRESH).
EIGENVALUE_THRESHOLD = 1e-5
#: A matrix whose smaller side is under this gets no α (WeightWatcher's ``min_evals``).
MIN_EIGENVALUES = 8
#: ``{metric: (title, y-axis title, log y)}`` of :class:`WeightSpectra`, in drawing order.
METRICS = {
    "spectral_norm": ("Spectral norm ‖W‖₂", "‖W‖₂", True),
    "frobenius_norm": ("Frobenius norm ‖W‖_F", "‖W‖_F", True),
    "stable_rank": ("Stable rank ‖W‖²_F / ‖W‖²₂", "stable rank", False),
    "alpha": ("Power-law exponent α of the ESD of WᵀW (WeightWatcher's fit)", "α", False),
}
_BLOCK = 1 << 22  # entries of one block of the KS distances' candidates × eigenvalues


@dataclass(frozen=True)
class PowerLawFit:
    """The power-law fit of one matrix's eigenvalues.

    Attributes:
        alpha: the exponent of the density ∝ λ^−α above ``xmin``; NaN when not fitted.
        xmin: where the power law starts (an eigenvalue); NaN when not fitted.
        ks_distance: the Kolmogorov–Smirnov distance D of the fit above ``xmin``.
        tail: how many eigenvalues are ≥ ``xmin`` (those fitted).
        reason: why there is no fit; empty when there is one.
    """

    alpha: float
    xmin: float
    ks_distance: float
    tail: int
    reason: str = ""


def fit_power_law(eigenvalues: np.ndarray, min_eigenvalues: int = MIN_EIGENVALUES) -> PowerLawFit:
    """The power law of ``eigenvalues``, x_min by least Kolmogorov–Smirnov distance.

    Vectorized over the candidates x_min: the sums of logarithms come from one cumulative sum,
    the KS distances from blocks of candidates × eigenvalues.

    Args:
        eigenvalues: the eigenvalues of WᵀW (any order); those ≤ 1e-5 are left out.
        min_eigenvalues: fewer eigenvalues than this get no fit.

    Example::

        fit = fit_power_law(np.linalg.svd(w, compute_uv=False) ** 2)
        fit.alpha, fit.xmin
    """
    x = np.sort(np.asarray(eigenvalues, dtype=np.float64))
    if len(x) < min_eigenvalues:
        return _no_fit(f"{len(x)} eigenvalues, fewer than {min_eigenvalues}")
    x = x[x > EIGENVALUE_THRESHOLD]
    if len(x) < 2:
        return _no_fit(f"{len(x)} eigenvalue(s) above {EIGENVALUE_THRESHOLD:g}")
    logs = np.log(x)
    n = len(x) - np.arange(len(x) - 1)  # eigenvalues ≥ each candidate x_min = x[i]
    tail_logs = np.cumsum(logs[::-1])[::-1][:-1]  # Σ_{j ≥ i} ln x_j
    with np.errstate(divide="ignore", invalid="ignore"):
        alphas = 1 + n / (tail_logs - n * logs[:-1])
    distances = np.full(len(n), np.inf)
    fitted = np.flatnonzero(np.isfinite(alphas) & (alphas > 1))
    step = max(1, _BLOCK // len(x))
    for start in range(0, len(fitted), step):
        distances[fitted[start : start + step]] = _ks_distances(
            logs, fitted[start : start + step], alphas
        )
    if not np.isfinite(distances).any():
        return _no_fit("no candidate x_min gives α > 1")
    best = int(np.argmin(distances))
    return PowerLawFit(float(alphas[best]), float(x[best]), float(distances[best]), int(n[best]))


def _ks_distances(logs: np.ndarray, candidates: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """max_j |1 − (x_j/x_i)^(1−α_i) − (j − i)/n_i| over j ≥ i, for each candidate i."""
    j = np.arange(len(logs))
    offset = j[None, :] - candidates[:, None]  # j − i: the empirical CDF's numerator
    n = (len(logs) - candidates)[:, None]
    ratio = logs[None, :] - logs[candidates, None]  # ln(x_j / x_i)
    theory = -np.expm1((1 - alphas[candidates, None]) * ratio)
    gap = np.where(offset >= 0, np.abs(theory - offset / n), 0.0)
    return gap.max(axis=1)


def _no_fit(reason: str) -> PowerLawFit:
    return PowerLawFit(np.nan, np.nan, np.nan, 0, reason)


@dataclass(frozen=True)
class MatrixSpectrum:
    """The spectral measures of one matrix.

    Attributes:
        spectral_norm: ‖W‖₂, the largest singular value.
        frobenius_norm: ‖W‖_F.
        stable_rank: ‖W‖²_F / ‖W‖²₂ (NaN for a zero matrix).
        fit: the power-law fit of the eigenvalues of WᵀW.
    """

    spectral_norm: float
    frobenius_norm: float
    stable_rank: float
    fit: PowerLawFit


def weight_matrix(tensor: np.ndarray) -> np.ndarray:
    """The matrix of a weight tensor: ``(out, in·k1·…)`` for ``(out, in, k1, ...)``.

    Example::

        weight_matrix(np.zeros((16, 3, 5, 5))).shape  # (16, 75)
    """
    tensor = np.asarray(tensor)
    if tensor.ndim < 2:
        raise DynamicsError(f"a weight matrix needs two or more dimensions, got {tensor.shape}")
    return tensor.reshape(tensor.shape[0], -1)


def matrix_spectrum(matrix: np.ndarray) -> MatrixSpectrum:
    """Spectral norm, Frobenius norm, stable rank and power-law fit of one matrix.

    Example::

        spectrum = matrix_spectrum(np.random.default_rng(0).normal(size=(64, 32)))
        spectrum.stable_rank, spectrum.fit.alpha
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    if not np.isfinite(matrix).all():
        return MatrixSpectrum(np.nan, np.nan, np.nan, _no_fit("not finite"))
    singular = np.linalg.svd(matrix, compute_uv=False)
    top = float(singular[0])
    frobenius = float(np.sqrt(np.sum(singular**2)))
    if top == 0.0:
        return MatrixSpectrum(0.0, 0.0, np.nan, _no_fit("zero matrix"))
    return MatrixSpectrum(top, frobenius, frobenius**2 / top**2, fit_power_law(singular**2))


@dataclass(frozen=True)
class WeightSpectra:
    """The spectral measures of a run's weight matrices at each stored state.

    Each measure is a ``(states, matrices)`` array, for θt (:attr:`weights`) and for
    θt − θ0 (:attr:`displacement`), with keys those of :data:`METRICS` and ``"xmin"``,
    ``"ks_distance"``, ``"tail"``.

    Attributes:
        steps: the stored states' steps (θ0, the snapshots, θT).
        layers: the weight matrices' parameter names.
        shapes: the parameters' shapes.
        weights: ``{measure: (states, matrices)}`` of θt.
        displacement: ``{measure: (states, matrices)}`` of θt − θ0.
        reasons: ``{"weights" | "displacement": (states, matrices)}`` why α is missing
            (empty strings where it is fitted).
    """

    steps: np.ndarray
    layers: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    weights: dict[str, np.ndarray]
    displacement: dict[str, np.ndarray]
    reasons: dict[str, np.ndarray]

    def table(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        """``(header, rows)``: one row per matrix at the last state, its measures as text
        ("-" where missing), for the command line and the report."""
        header = (
            "layer",
            "matrix",
            "‖W‖₂",
            "‖W‖_F",
            "stable rank",
            "α",
            "x_min",
            "KS D",
            "‖ΔW‖₂",
            "‖ΔW‖_F",
            "ΔW stable rank",
            "ΔW α",
            "no α because",
        )
        rows = []
        for i, (layer, shape) in enumerate(zip(self.layers, self.shapes)):
            w, d = ({k: v[-1, i] for k, v in m.items()} for m in (self.weights, self.displacement))
            why = "; ".join(
                f"{what}: {self.reasons[kind][-1, i]}"
                for kind, what in (("weights", "W"), ("displacement", "ΔW"))
                if self.reasons[kind][-1, i]
            )
            rows.append(
                (
                    layer,
                    "×".join(map(str, _matrix_shape(shape))),
                    *(_text(w[k]) for k in ("spectral_norm", "frobenius_norm", "stable_rank")),
                    *(_text(w[k]) for k in ("alpha", "xmin", "ks_distance")),
                    *(_text(d[k]) for k in ("spectral_norm", "frobenius_norm", "stable_rank")),
                    _text(d["alpha"]),
                    why,
                )
            )
        return header, rows

    def last(self) -> list[dict]:
        """One row per matrix at the last state: name, shape, matrix shape and the measures of
        θT and of θT − θ0 (None for NaN), JSON-ready."""
        rows = []
        for i, (layer, shape) in enumerate(zip(self.layers, self.shapes)):
            row: dict = {"layer": layer, "shape": list(shape), "matrix": _matrix_shape(shape)}
            for kind, measures in (("weights", self.weights), ("displacement", self.displacement)):
                row[kind] = {k: _number(v[-1, i]) for k, v in measures.items()}
                row[kind]["tail"] = int(measures["tail"][-1, i])
                row[kind]["alpha_reason"] = str(self.reasons[kind][-1, i])
            rows.append(row)
        return rows


def _matrix_shape(shape: Sequence[int]) -> list[int]:
    return [int(shape[0]), int(prod(shape[1:]))]


def _text(value: float) -> str:
    return f"{value:.4g}" if np.isfinite(value) else "-"


def _number(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def weight_spectra(
    run: Run, last_only: bool = False, max_states: int | None = None
) -> WeightSpectra:
    """The spectral measures of the run's weight matrices at each stored state.

    Args:
        run: a run that stored θ0 (ParameterDisplacement) and its parameter layout.
        last_only: measure the last stored state alone (θT, or the last snapshot).
        max_states: measure at most this many states, evenly spread over the stored ones
            (θ0 and the last kept); all of them when None.

    Raises:
        DynamicsError: the run stored no θ0, no layout, or no parameter of two or more
            dimensions.

    Example::

        spectra = weight_spectra(open_run("runs/demo/shifted.h5"))
        spectra.weights["alpha"][-1]  # α of each matrix at θT
    """
    layout = run.attrs.get(names.ATTR_LAYOUT)  # read as text: no torch for an offline view
    if not layout:
        raise DynamicsError(f"{run.path}: no parameter layout stored")
    states = run.stored_states(buffers=False)  # raises a RunFileError (a DynamicsError) without θ0
    shapes = [tuple(int(d) for d in s) for s in layout["shapes"]]
    ends = np.cumsum([prod(s) for s in shapes])
    starts = ends - [prod(s) for s in shapes]
    chosen = [i for i, s in enumerate(shapes) if len(s) >= 2]
    if not chosen:
        raise DynamicsError(f"{run.path}: no parameter with two or more dimensions")
    theta0 = states[0].theta
    # A snapshot at step 0 (or at the last step) repeats θ0 (θT): one state per step.
    states = [state for i, state in enumerate(states) if i == 0 or state.step != states[i - 1].step]
    measured = [states[-1]] if last_only else states
    if max_states is not None and len(measured) > max_states:
        kept = np.unique(np.linspace(0, len(measured) - 1, max(2, max_states)).round())
        measured = [measured[int(i)] for i in kept]
    out = {
        kind: {k: np.full((len(measured), len(chosen)), np.nan) for k in _MEASURES}
        for kind in ("weights", "displacement")
    }
    reasons = {kind: np.full((len(measured), len(chosen)), "", dtype=object) for kind in out}
    for s, state in enumerate(measured):
        for c, i in enumerate(chosen):
            w = state.theta[starts[i] : ends[i]].astype(np.float64).reshape(shapes[i])
            w0 = theta0[starts[i] : ends[i]].astype(np.float64).reshape(shapes[i])
            for kind, matrix in (("weights", w), ("displacement", w - w0)):
                spectrum = matrix_spectrum(weight_matrix(matrix))
                for key, value in _values(spectrum).items():
                    out[kind][key][s, c] = value
                reasons[kind][s, c] = spectrum.fit.reason
    return WeightSpectra(
        steps=np.array([state.step for state in measured]),
        layers=tuple(layout["names"][i] for i in chosen),
        shapes=tuple(shapes[i] for i in chosen),
        weights=out["weights"],
        displacement=out["displacement"],
        reasons=reasons,
    )


_MEASURES = (*METRICS, "xmin", "ks_distance", "tail")


def _values(spectrum: MatrixSpectrum) -> dict[str, float]:
    fit = spectrum.fit
    return {
        "spectral_norm": spectrum.spectral_norm,
        "frobenius_norm": spectrum.frobenius_norm,
        "stable_rank": spectrum.stable_rank,
        "alpha": fit.alpha,
        "xmin": fit.xmin,
        "ks_distance": fit.ks_distance,
        "tail": fit.tail,
    }
