"""What the autoencoder runs' BiasComponent series say: does the bias-only decode resemble the
images early and depart later (the paper's "transient use", seed 002 Fig. 5), per variant?

Reads the run files ``dynamics run configs/autoencoder.yaml --out DIR`` wrote and prints, per
variant and recorded layer, at a few steps and at the peak:

- ``corr(bias, y)``: correlation of the bias-only decode with the target image (per example,
  the cosine of the mean-centred pixels, averaged over the probe batch): does it show *this*
  image's structure, not just a bright blob;
- ``corr(full, y)``: the same for the full reconstruction, for scale;
- ``cos(bias, full)``: how close the bias-only decode is to the full reconstruction;
- ``share``: ‖h̄·1‖² / ‖h‖², the hidden state's energy in its bias component.

Usage: ``python benchmarks/bench_bias_component.py DIR [--steps 0 20 50 100 200 500]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dynamics.store import names, open_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, help="folder of unshifted.h5 and shifted.h5")
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 20, 50, 100, 200, 500])
    args = parser.parse_args()
    for path in sorted(args.runs.glob("*.h5"), reverse=True):  # unshifted first
        run = open_run(path)
        series = run.series(names.BIAS_COMPONENT)
        step = np.asarray(series.step)
        shown = [int(np.argmin(np.abs(step - s))) for s in args.steps] + [len(step) - 1]
        layers = series.columns["bias_corr_target"]
        print(f"\n== {run.name} ({path})")
        print(f"{'layer':<10} {'quantity':<16}" + "".join(f"{int(step[i]):>8}" for i in shown))
        for j, layer in enumerate(layers):
            for label, key in (
                ("corr(bias, y)", "bias_corr_target"),
                ("corr(full, y)", "full_corr_target"),
                ("cos(bias, full)", "bias_cos_full"),
                ("share", "bias_share"),
            ):
                values = np.asarray(series.values[key])
                values = values[:, j] if values.ndim == 2 else values
                cells = "".join(f"{values[i]:8.3f}" for i in shown)
                print(f"{layer:<10} {label:<16}{cells}")
            corr = np.asarray(series.values["bias_corr_target"])[:, j]
            peak = int(np.nanargmax(corr))
            print(
                f"{layer:<10} peak corr(bias, y) {corr[peak]:.3f} at step {int(step[peak])}, "
                f"final {corr[-1]:.3f} (step {int(step[-1])})"
            )


if __name__ == "__main__":
    main()
