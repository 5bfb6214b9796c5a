"""Smoke test of the installed wheel, as a user installs it: the library and the command.

Run by `.ci/wheel-smoke` inside a fresh virtual environment holding only the built wheel, from a
folder outside the repository, so nothing can be imported from the source tree: the packaged
config is named, not a path (`dynamics run teacher_student`), then `dynamics report` reads what it
wrote, and a BoringModel recorded from Python goes through `dynamics info` and `report`.
"""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.demos.boring_classes import BoringModel

import dynamics
from dynamics.callbacks import DynamicsRecorder

DISTRIBUTION = "dynamics-for-pytorch"

assert "site-packages" in dynamics.__file__, f"dynamics imported from {dynamics.__file__}"
assert importlib.metadata.version(DISTRIBUTION) == dynamics.__version__, "distribution version"
assert importlib.metadata.packages_distributions()["dynamics"] == [DISTRIBUTION]
console = Path(sys.executable).with_name("dynamics")


def command(*arguments: object) -> None:
    subprocess.run([console, *map(str, arguments)], check=True)


command("run", "teacher_student", "--steps", 200, "--out", "experiment", "--no-progress")
students = sorted(Path("experiment").glob("*.h5"))
assert [path.name for path in students] == ["shifted.h5", "unshifted.h5"], students
command("report", "experiment", "-o", "experiment.html")
assert Path("experiment.html").stat().st_size > 0

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
command("info", run_file)
command("report", run_file, "-o", "smoke.html")
print(
    f"wheel smoke test passed: {DISTRIBUTION} {dynamics.__version__}; teacher_student "
    f"{[path.name for path in students]}; {len(dynamics.open_run(run_file).groups)} series groups"
)
