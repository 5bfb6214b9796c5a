"""The notebook API: a run's series as pandas tables and xarray arrays, its views as figures.

    python examples/notebook_api.py [OUT_DIR]

Needs the notebook extra (pip install 'dynamics-for-pytorch[notebook]': pandas and xarray).
Records a short run into OUT_DIR/run.h5 (default: a new temporary folder), then reads it as a
notebook would and writes one figure, OUT_DIR/loss.html. In Jupyter a figure shows inline.
"""

import sys
import tempfile
from pathlib import Path

import pytorch_lightning as pl
from tiny_model import TinyStudent, quiet_trainer, teacher_data

import dynamics
from dynamics.analysis import figures
from dynamics.callbacks import DynamicsRecorder, HiddenStateNorms, LoggedMetrics, TrainingLoss

out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dynamics-example-"))
out.mkdir(parents=True, exist_ok=True)
pl.seed_everything(0, verbose=False)
probes = [TrainingLoss(), LoggedMetrics(), HiddenStateNorms(every_n_steps=5)]
train, held_out = teacher_data()
quiet_trainer(60, [DynamicsRecorder(out / "run.h5", probes=probes, overwrite=True)]).fit(
    TinyStudent(), train, held_out
)

run = dynamics.open_run(out / "run.h5")
print("groups:", sorted(run.groups), "status:", run.status().state)

norms = run.series("hidden_norms").to_pandas()  # index step; columns (series, column)
print(norms["norm"].tail(3))  # steps × layers
long = run.series("loss").to_pandas(long=True)  # columns step, series, column, value
print(long.describe())

tree = run.to_xarray()  # an xarray DataTree, one node per group
print(tree["hidden_norms"]["norm"].sel(layer="blocks.1").values[-3:])

figure = figures.loss(run)  # a plotly Figure, the view `dynamics report` draws
figure.write_html(out / "loss.html")
print("wrote", out / "loss.html")
