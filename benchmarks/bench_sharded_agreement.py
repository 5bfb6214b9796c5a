r"""Every probe under FSDP1 and FSDP2 against DDP: the largest relative difference per group.

One seed, one model (the teacher–student residual MLP, GELU, width 16, 3 blocks), two forked
gloo processes on the CPU, the same per-rank batches under each strategy: a DDP fit (the
unsharded reference), a ``FSDPStrategy`` fit (FSDP1, through the test helpers' CPU subclass) and
a ``ModelParallelStrategy`` fit with ``fully_shard`` (FSDP2), each recording every probe. Prints,
per series group and stored vector, the largest |sharded − DDP| / max(|DDP|, tiny) over every
entry (eigenvectors up to sign), whether the layout and θ0's hash equal DDP's, every probe that
stepped aside.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sharded_agreement.py [--steps 6]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the forked FSDP strategies of the test helpers

from dynamics import open_run  # noqa: E402
from dynamics.callbacks import (  # noqa: E402
    BiasAudit,
    BiasComponent,
    DynamicsRecorder,
    EigenspaceOverlap,
    EigenvectorSnapshots,
    GradientPlane,
    GradientShare,
    HessianDensity,
    HessianSpectrum,
    HessianTrace,
    HiddenStateNorms,
    LossChangeSplit,
    ParameterDisplacement,
    TrainingLoss,
    TrajectoryGeometry,
)
from dynamics.experiments import TeacherStudentData, TeacherStudentModule  # noqa: E402
from tests import sharded  # noqa: E402

ARCH = dict(width=16, expansion=2, depth=3, activation="gelu")
TINY = 1e-12


def probes() -> list:
    """Every probe of the toolkit that measures during a fit, each due every step or two."""
    hessian = [
        HessianTrace(hvp=12),
        GradientShare(),
        HessianDensity(runs=2, steps=8),
        EigenspaceOverlap(),
        EigenvectorSnapshots(budget_mb=1),
    ]
    return [
        TrainingLoss(),
        HiddenStateNorms(unit_health=True),
        ParameterDisplacement(),
        TrajectoryGeometry(per_tensor=True),
        GradientPlane(),
        HessianSpectrum(k=3, every_n_steps=2, tol=1e-6, measurements=hessian),
        LossChangeSplit(groups="kind"),
        BiasComponent(layers=["student.blocks.*.act"], every_n_steps=2),
        BiasAudit(draws=2),
    ]


def fit(name: str, path: Path, steps: int) -> None:
    """One recorded fit under strategy ``name``."""
    torch.manual_seed(0)
    module = sharded.module_for(name, TeacherStudentModule)(**ARCH)
    data = TeacherStudentData(**ARCH, batch_size=8)
    sharded.fit(name, module, data, [DynamicsRecorder(path, probes())], max_steps=steps)


def difference(got: np.ndarray, expected: np.ndarray, signed: bool = False) -> float:
    """The largest relative difference; rows of eigenvectors compared up to sign."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    if got.shape != expected.shape:
        return float("inf")
    if signed and got.ndim >= 1:
        flat_got, flat_expected = (
            got.reshape(-1, got.shape[-1]),
            expected.reshape(-1, got.shape[-1]),
        )
        signs = np.sign(np.sum(flat_got * flat_expected, axis=-1, keepdims=True))
        got = (flat_got * np.where(signs == 0, 1, signs)).reshape(expected.shape)
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(got)):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(expected[finite]).max()), TINY)
    return float(np.abs(got[finite] - expected[finite]).max() / scale)


def compare(reference, run) -> dict[str, float]:
    """``{group or vector: largest relative difference}`` of ``run`` against ``reference``."""
    found: dict[str, float] = {}
    for group in reference.groups:
        expected, got = reference.series(group), run.series(group)
        worst = 0.0
        for name in expected.values:
            worst = max(worst, difference(got[name], expected[name], "eigenvector" in name))
        found[group] = max(worst, 0.0 if np.array_equal(got.step, expected.step) else np.inf)
    for name in reference.vector_names:
        expected, got = reference.vector(name), run.vector(name)
        if expected is not None and got is not None:
            found[f"vector {name}"] = difference(got, expected)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of each fit")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        paths = {name: Path(folder) / f"{name}.h5" for name in sharded.STRATEGIES}
        for name, path in paths.items():
            fit(name, path, args.steps)
        runs = {name: open_run(path) for name, path in paths.items()}
        reference = runs["ddp"]
        found = {name: compare(reference, runs[name]) for name in ("fsdp1", "fsdp2")}
        print(f"{'group or vector':<44} {'FSDP1':>10} {'FSDP2':>10}")
        for key in found["fsdp1"]:
            print(
                f"{key:<44} {found['fsdp1'][key]:>10.2e} {found['fsdp2'].get(key, np.inf):>10.2e}"
            )
        for name in ("fsdp1", "fsdp2"):
            run = runs[name]
            same_layout = run.layout.to_dict() == reference.layout.to_dict()
            same_hash = run.theta0_sha256 == reference.theta0_sha256
            stepped_aside = [f"{e.probe}: {e.message}" for e in run.events() if e.kind != "warning"]
            print(
                f"{name}: layout {'equal' if same_layout else 'DIFFERENT'}, θ0 hash "
                f"{'equal' if same_hash else 'DIFFERENT'}; "
                f"stepped aside: {stepped_aside or 'none'}"
            )


if __name__ == "__main__":
    main()
