"""Compare two runs: the same θ0 at two learning rates, drawn side by side.

    python examples/compare_two_runs.py [OUT_DIR]

Writes OUT_DIR/lr_0.05.h5, OUT_DIR/lr_0.2.h5 and OUT_DIR/compare.html (default: a new temporary
folder). The comparison says first whether the runs can be compared at all (same layout, same
θ0, what differs), then draws every series they both recorded.
"""

import sys
import tempfile
from pathlib import Path

import pytorch_lightning as pl
from tiny_model import TinyStudent, quiet_trainer, teacher_data

import dynamics
from dynamics.callbacks import DynamicsRecorder, LoggedMetrics, ParameterDisplacement, TrainingLoss
from dynamics.cli import main as dynamics_command

out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dynamics-example-"))
out.mkdir(parents=True, exist_ok=True)
runs = []
for lr in (0.05, 0.2):
    pl.seed_everything(0, verbose=False)  # the same seed: both runs start from the same θ0
    path = out / f"lr_{lr}.h5"
    probes = [TrainingLoss(), LoggedMetrics(), ParameterDisplacement(every_n_steps=5)]
    train, held_out = teacher_data()
    recorder = DynamicsRecorder(path, probes=probes, overwrite=True)
    quiet_trainer(100, [recorder]).fit(TinyStudent(lr=lr), train, held_out)
    runs.append(path)

for path in runs:
    run = dynamics.open_run(path)
    print(f"{path.name}: held-out loss {float(run.heldout_loss().values[-1]):.4f}")
# No loss barriers (--barrier-points 0): they rebuild the model, and this one lives in a script.
arguments = ["compare", *map(str, runs), "-o", str(out / "compare.html"), "--overwrite"]
sys.exit(dynamics_command([*arguments, "--barrier-points", "0"]))
