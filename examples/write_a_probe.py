"""Write your own probe: a class that turns the module's state into rows, checked, then recorded.

    python examples/write_a_probe.py [OUT_DIR]

Defines ``WeightNorms`` (‖W‖ of every parameter tensor), checks it keeps the probe contract with
``check_probe``, records it beside a built-in probe into OUT_DIR/run.h5 (default: a new temporary
folder) and draws it with `dynamics report`, which needs no change to draw a new probe's series.
"""

import sys
import tempfile
from pathlib import Path

import pytorch_lightning as pl
import torch
from tiny_model import TinyStudent, quiet_trainer, teacher_data

import dynamics
from dynamics.callbacks import DynamicsRecorder, Probe, SeriesSpec, TrainingLoss, check_probe
from dynamics.cli import main as dynamics_command
from dynamics.store import View


class WeightNorms(Probe):
    """‖W‖ of every parameter tensor."""

    name = "weight_norms"  # the group in the run file

    def __init__(self, every_n_steps: int = 1) -> None:
        super().__init__(every_n_steps)
        self.tensors: tuple[str, ...] = ()  # parameter names, read at setup

    def setup(self, fit, module, batch):
        self.tensors = tuple(name for name, _ in module.named_parameters())

    def series(self):
        view = View("lines", "Weight norm per tensor", "‖W‖")  # how report draws it
        return {
            self.name: {"norm": SeriesSpec((len(self.tensors),), columns=self.tensors, view=view)}
        }

    def on_step_end(self, fit, module, batch, outputs, step):
        # Detached tensors, left on the device: the recorder copies whole blocks to the host.
        norms = torch.stack([p.detach().norm() for p in module.parameters()])
        return {self.name: {"norm": norms}}


# The contract: rows as declared; .grad, parameters, buffers, flags and RNGs untouched; a
# state_dict that survives a weights_only checkpoint. check_probe fails loudly otherwise.
train, held_out = teacher_data()
batch = next(iter(train))
series = check_probe(WeightNorms(), TinyStudent(), batch=batch, steps=3)
print("check_probe passed:", series["weight_norms"]["norm"].shape, "(steps × tensors)")

out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dynamics-example-"))
out.mkdir(parents=True, exist_ok=True)
pl.seed_everything(0, verbose=False)
recorder = DynamicsRecorder(
    out / "run.h5", probes=[TrainingLoss(), WeightNorms(every_n_steps=5)], overwrite=True
)
quiet_trainer(50, [recorder]).fit(TinyStudent(), train, held_out)
norms = dynamics.open_run(out / "run.h5").series("weight_norms")
print("rows:", len(norms.step), "first tensors:", norms.columns["norm"][:2])
sys.exit(
    dynamics_command(["report", str(out / "run.h5"), "-o", str(out / "run.html"), "--overwrite"])
)
