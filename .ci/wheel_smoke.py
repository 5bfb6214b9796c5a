"""Smoke test of the installed wheel: record a BoringModel, then `dynamics info` and `report`.

Run by `.ci/wheel-smoke` inside a fresh virtual environment holding only the built wheel, from a
folder outside the repository, so nothing can be imported from the source tree.
"""

import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.demos.boring_classes import BoringModel

import dynamics
from dynamics.callbacks import DynamicsRecorder

assert "site-packages" in dynamics.__file__, f"dynamics imported from {dynamics.__file__}"
run_file = Path("smoke.h5")
trainer = pl.Trainer(
    max_steps=4,
    callbacks=[DynamicsRecorder(run_file)],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(BoringModel())
console = Path(sys.executable).with_name("dynamics")
for command in (["info", run_file], ["report", run_file, "-o", "smoke.html"]):
    subprocess.run([console, *map(str, command)], check=True)
print(f"wheel smoke test passed: {len(dynamics.open_run(run_file).groups)} series groups")
