"""Record a run: attach the recorder to a Lightning fit, then read what it wrote.

    python examples/record_a_run.py [OUT_DIR]

Writes OUT_DIR/run.h5 and OUT_DIR/run.html (default: a new temporary folder).
"""

import sys
import tempfile
from pathlib import Path

import pytorch_lightning as pl
from tiny_model import TinyStudent, quiet_trainer, teacher_data

import dynamics
from dynamics.callbacks import (
    DynamicsRecorder,
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.cli import main as dynamics_command

out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dynamics-example-"))
out.mkdir(parents=True, exist_ok=True)
pl.seed_everything(0, verbose=False)
recorder = DynamicsRecorder(
    out / "run.h5",
    probes=[
        TrainingLoss(),
        LoggedMetrics(),  # val_loss, after every validation run
        HiddenStateNorms(every_n_steps=5),
        ParameterDisplacement(every_n_steps=5),
        HessianSpectrum(k=2, every_n_steps=50),  # sparse: each record costs tens of HVPs
    ],
    overwrite=True,
)
train, held_out = teacher_data()
quiet_trainer(100, [recorder]).fit(TinyStudent(), train, held_out)

run = dynamics.open_run(out / "run.h5")
print("state:", run.status().state)
print("final training loss:", float(run.train_loss().values[-1]))
print("held-out loss:", float(run.heldout_loss().values[-1]))
norms = run.series("hidden_norms")
last = {
    layer: round(float(norm), 4) for layer, norm in zip(norms.columns["norm"], norms["norm"][-1])
}
print("hidden norms at the last record:", last)
print("top Hessian eigenvalues:", run.series("hessian")["eigenvalues"][-1].tolist())
# The same page `dynamics report run.h5 -o run.html` writes.
sys.exit(
    dynamics_command(["report", str(out / "run.h5"), "-o", str(out / "run.html"), "--overwrite"])
)
