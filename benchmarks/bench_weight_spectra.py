"""Weight spectra: time per stored state, and agreement with WeightWatcher on the same matrices.

Models: the teacher–student student (``dynamics.experiments.teacher_student.model.ResidualMLP``,
width 64, expansion 4, depth 4: eight 64×256 / 256×64 matrices) and a small SDPA transformer
(``dynamics.experiments.char_gpt.model.CharGPT``, context 128, width 128, depth 4: embeddings,
qkv, projections and MLP matrices, 18 in all). θ0 is the model's initialization, θt the same
plus Gaussian noise of 1% of each tensor's scale (the measures' cost does not depend on the
values).

1. Time per state: every weight matrix of θt and of θt − θ0 through
   :func:`~dynamics.analysis.measures.weight_spectra.matrix_spectrum` (one SVD and the
   power-law fit each), the work ``weight_spectra`` does per stored state; median of ``--reps``.
2. Beside it, in the same process, alternating: θt alone (half the work) and
   ``analyze()`` of a ``weightwatcher.WeightWatcher(model)`` (its defaults) on the same model: the
   median ratio, and the largest |α − α_WW|, |x_min − x_min_WW| / x_min_WW over the matrices
   both measured. Skipped with a line when weightwatcher is not installed.

Usage: ``python benchmarks/bench_weight_spectra.py [--reps 5] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import nn

from dynamics.analysis.measures.weight_spectra import matrix_spectrum, weight_matrix
from dynamics.experiments.char_gpt.model import CharGPT
from dynamics.experiments.teacher_student.model import ResidualMLP


def _models() -> dict[str, Callable[[], nn.Module]]:
    return {
        "teacher-student (64, 4, 4)": lambda: ResidualMLP(width=64, expansion=4, depth=4),
        "CharGPT (128 wide, 4 deep)": lambda: CharGPT(context=128, width=128, depth=4, heads=4),
    }


def _matrices(model: nn.Module) -> dict[str, np.ndarray]:
    return {
        name: p.detach().double().numpy()
        for name, p in model.named_parameters()
        if p.ndim >= 2 and p.requires_grad
    }


def _measure(weights: dict[str, np.ndarray], theta0: dict[str, np.ndarray] | None) -> dict:
    out = {}
    for name, w in weights.items():
        out[name] = matrix_spectrum(weight_matrix(w))
        if theta0 is not None:
            matrix_spectrum(weight_matrix(w - theta0[name]))
    return out


def _timed(work: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        import weightwatcher

        logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    except ImportError:
        weightwatcher = None
        print("weightwatcher not installed: no comparison (pip install weightwatcher)")
    for label, build in _models().items():
        torch.manual_seed(0)
        model = build()
        theta0 = _matrices(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * p.std().nan_to_num() * torch.randn_like(p))
        weights = _matrices(model)
        per_state = [_timed(partial(_measure, weights, theta0))[0] for _ in range(args.reps)]
        shapes = sorted({w.shape for w in weights.values()})
        print(f"{label}: {len(weights)} matrices {shapes}")
        print(f"  per state (θt and θt − θ0): {statistics.median(per_state) * 1e3:.1f} ms")
        if weightwatcher is None:
            continue
        ours, theirs = [], []
        for _ in range(args.reps):
            seconds, spectra = _timed(partial(_measure, weights, None))
            ours.append(seconds)
            seconds, found = _timed(weightwatcher.WeightWatcher(model=model).analyze)
            theirs.append(seconds)
        alphas, xmins = [], []
        for _, row in found.iterrows():
            name = f"{row['longname']}.weight"
            if name in spectra and np.isfinite(spectra[name].fit.alpha):
                fit = spectra[name].fit
                alphas.append(abs(fit.alpha - row["alpha"]))
                xmins.append(abs(fit.xmin - row["xmin"]) / row["xmin"])
        ratio = statistics.median(o / t for o, t in zip(ours, theirs))
        print(
            f"  θt alone {statistics.median(ours) * 1e3:.1f} ms, weightwatcher.analyze "
            f"{statistics.median(theirs) * 1e3:.1f} ms: ratio {ratio:.2f}"
        )
        print(
            f"  against WeightWatcher on {len(alphas)} matrices: max |Δα| {max(alphas):.2e}, "
            f"max relative |Δx_min| {max(xmins):.2e}"
        )


if __name__ == "__main__":
    main()
