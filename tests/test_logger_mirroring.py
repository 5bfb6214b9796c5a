"""Series mirrored to the Trainer's loggers: scalars, and vectors one metric per named column."""

import csv

import numpy as np
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dynamics import open_run
from dynamics.callbacks import (
    DynamicsRecorder,
    HessianSpectrum,
    HiddenStateNorms,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.experiments import TeacherStudentData, TeacherStudentModule


def test_vector_series_reach_csv_and_tensorboard_one_metric_per_column(tmp_path, quiet_trainer):
    arch = dict(width=8, expansion=2, depth=2)
    loggers = [CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")]
    probes = [
        TrainingLoss(),
        HiddenStateNorms(),
        HessianSpectrum(k=2, every_n_steps=2),
        ParameterDisplacement(snapshot_every_n_steps=1),
    ]
    recorder = DynamicsRecorder(tmp_path / "r.h5", probes, log_to_loggers=True)
    quiet_trainer(max_steps=4, logger=loggers, log_every_n_steps=1, callbacks=[recorder]).fit(
        TeacherStudentModule(**arch), TeacherStudentData(**arch, batch_size=16)
    )
    run = open_run(tmp_path / "r.h5")
    norms, bias, hessian = (run.series(g) for g in ("hidden_norms", "activation_bias", "hessian"))
    expected = {
        **{
            f"dynamics/hidden_norms/norm/{layer}": (norms.step, norms["norm"][:, i])
            for i, layer in enumerate(norms.columns["norm"])
        },
        **{
            f"dynamics/activation_bias/mean/{layer}": (bias.step, bias["mean"][:, i])
            for i, layer in enumerate(bias.columns["mean"])
        },
        **{
            f"dynamics/hessian/eigenvalues/{column}": (hessian.step, hessian["eigenvalues"][:, i])
            for i, column in enumerate(hessian.columns["eigenvalues"])
        },
        "dynamics/loss/train": (run.series("loss").step, run.series("loss")["train"]),
    }
    assert "dynamics/hessian/eigenvalues/lambda_2" in expected
    assert len(norms.columns["norm"]) == 2 and len(bias.columns["mean"]) == 2

    with open(f"{loggers[0].log_dir}/metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    tensorboard = EventAccumulator(loggers[1].log_dir)
    tensorboard.Reload()
    for key, (steps, values) in expected.items():
        logged = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
        np.testing.assert_array_equal([s for s, _ in logged], steps, err_msg=key)
        np.testing.assert_allclose([v for _, v in logged], values, rtol=1e-6, err_msg=key)
        scalars = tensorboard.Scalars(key)
        np.testing.assert_array_equal([e.step for e in scalars], steps, err_msg=key)
        np.testing.assert_allclose([e.value for e in scalars], values, rtol=1e-6, err_msg=key)
    # long unnamed rows are not metrics; the named per-tensor displacement is
    assert not any("snapshots" in key for key in rows[0])
    assert "dynamics/displacement/per_tensor/student.blocks.0.norm.weight" in rows[0]
