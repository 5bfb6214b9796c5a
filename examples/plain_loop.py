"""Record a plain PyTorch loop, stop at a checkpoint, resume it into the same run file.

    python examples/plain_loop.py [OUT_DIR]

Writes OUT_DIR/run.h5, OUT_DIR/last.ckpt and OUT_DIR/run.html (default: a new temporary folder).
"""

import sys
import tempfile
from pathlib import Path

import torch
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
train, held_out = teacher_data()
STEPS = 100
batches = [batch for epoch in range(8) for batch in train]  # 8 epochs of 14 batches, in order


def loss_fn(model, batch):  # loss_fn(model, batch): what the probes' extra passes differentiate
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def fit(model, optimizer, first_step, last_step, state=None):
    """Train from ``first_step`` to ``last_step``, recorded; the recorder's state at the end."""
    rec = dynamics.record(
        out / "run.h5",
        model,
        optimizer,
        loss_fn=loss_fn,
        probes=[
            TrainingLoss(),
            LoggedMetrics(),  # what rec.validation(metrics=...) hands it
            HiddenStateNorms(every_n_steps=5),
            ParameterDisplacement(every_n_steps=5),
            HessianSpectrum(k=2, every_n_steps=50),
        ],
        expected_steps=STEPS,
        overwrite=state is None,  # a new run replaces an old file; a resumed one continues it
    )
    if state is not None:
        rec.load_state_dict(state)  # before `with`: the run file continues where it stopped
    with rec:
        for step in range(first_step, last_step):
            batch = batches[step]
            with rec.batch(batch) as b:  # before the forward: probes arm their hooks
                loss = loss_fn(model, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                b.loss(loss)  # after the optimizer's step: the step's rows are recorded
            if (step + 1) % 25 == 0:
                with torch.no_grad():
                    val_loss = torch.stack([loss_fn(model, b) for b in held_out]).mean()
                rec.validation(metrics={"val_loss": val_loss})
        return rec.state_dict()  # every rank calls it together under DDP


torch.manual_seed(0)
model = TinyStudent()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
state = fit(model, optimizer, 0, 60)
torch.save(
    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "dynamics": state},
    out / "last.ckpt",
)

# Later, in another process: restore the loop and the recorder, and go on to the end.
checkpoint = torch.load(out / "last.ckpt", weights_only=True)
model = TinyStudent()
model.load_state_dict(checkpoint["model"])
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
optimizer.load_state_dict(checkpoint["optimizer"])
fit(model, optimizer, 60, STEPS, state=checkpoint["dynamics"])

run = dynamics.open_run(out / "run.h5")
print("state:", run.status().state, "- steps recorded:", len(run.series("loss")))
print("final training loss:", float(run.train_loss().values[-1]))
print("held-out loss:", float(run.heldout_loss().values[-1]))
print("top Hessian eigenvalues:", run.series("hessian")["eigenvalues"][-1].tolist())
sys.exit(
    dynamics_command(["report", str(out / "run.h5"), "-o", str(out / "run.html"), "--overwrite"])
)
