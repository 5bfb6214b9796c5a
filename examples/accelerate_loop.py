"""Record a loop that accelerate runs, with gradient accumulation, then read what it wrote.

    python examples/accelerate_loop.py [OUT_DIR]

Writes OUT_DIR/run.h5 and OUT_DIR/run.html (default: a new temporary folder). Launched with
``accelerate launch`` on several processes, rank zero writes the one file.
"""

import sys
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator
from tiny_model import TinyStudent, teacher_data

import dynamics
from dynamics.callbacks import (
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.cli import main as dynamics_command

out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dynamics-example-"))
out.mkdir(parents=True, exist_ok=True)


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


torch.manual_seed(0)
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)  # cpu=True: this example's
model = TinyStudent()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
train, held_out = teacher_data()
model, optimizer, train, held_out = accelerator.prepare(model, optimizer, train, held_out)
probes = [
    TrainingLoss(),  # the mean of each step's two micro-batch losses
    LoggedMetrics(),
    HiddenStateNorms(every_n_steps=5),
    ParameterDisplacement(every_n_steps=5),
    HessianSpectrum(k=2, every_n_steps=20),
]
record = dynamics.record(
    out / "run.h5",
    model,
    optimizer,
    loss_fn=loss_fn,
    probes=probes,
    accelerator=accelerator,  # its accumulation, sync_gradients and precision
    expected_steps=4 * len(train) // 2,
    overwrite=True,
)
with record as rec:
    for _epoch in range(4):
        for batch in train:
            with accelerator.accumulate(model), rec.batch(batch) as b:
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                b.loss(loss)  # unscaled: accelerate divides by the accumulation itself
        with torch.no_grad():
            val_loss = torch.stack([loss_fn(model, b) for b in held_out]).mean()
        rec.validation(metrics={"val_loss": accelerator.reduce(val_loss, "mean")})

if accelerator.is_main_process:
    run = dynamics.open_run(out / "run.h5")
    print("state:", run.status().state, "- steps recorded:", len(run.series("loss")))
    print("held-out loss by epoch:", run.heldout_loss().values.round(4).tolist())
    report = ["report", str(out / "run.h5"), "-o", str(out / "run.html"), "--overwrite"]
    sys.exit(dynamics_command(report))
