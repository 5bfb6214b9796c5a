"""Record a Hugging Face Trainer fit: a tiny GPT-2 learns to count, with DynamicsCallback.

    python examples/huggingface_trainer.py [OUT_DIR]

Writes OUT_DIR/run.h5 and OUT_DIR/run.html (default: a new temporary folder).
"""

import sys
import tempfile
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

import dynamics
from dynamics.callbacks import (
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.cli import main as dynamics_command
from dynamics.integrations.huggingface import DynamicsCallback

out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dynamics-example-"))
out.mkdir(parents=True, exist_ok=True)


def counting(count: int, seed: int) -> list[dict[str, list[int]]]:
    """Sequences counting up from a random start (mod 64): a pattern a tiny model learns."""
    starts = torch.randint(0, 64, (count,), generator=torch.Generator().manual_seed(seed))
    return [
        {"input_ids": ids, "labels": ids}
        for ids in ((start + torch.arange(16)) % 64 for start in starts.tolist())
    ]


torch.manual_seed(0)
config = GPT2Config(
    n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
)
model = GPT2LMHeadModel(config)  # built from a config: nothing is downloaded
callback = DynamicsCallback(
    out / "run.h5",
    probes=[
        TrainingLoss(),
        LoggedMetrics(["eval_loss"]),  # the Trainer's evaluation loss, at each evaluation
        HiddenStateNorms(every_n_steps=5),
        ParameterDisplacement(every_n_steps=5),
        HessianSpectrum(k=2, every_n_steps=20),  # sparse: each record costs tens of HVPs
    ],
    overwrite=True,
)
with tempfile.TemporaryDirectory() as checkpoints:  # the Trainer's own output folder
    args = TrainingArguments(
        output_dir=checkpoints,
        max_steps=40,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,  # the recorded loss is the step's, over both
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=counting(256, seed=1),
        eval_dataset=counting(32, seed=2),
        data_collator=default_data_collator,
        callbacks=[callback],
    )
    try:
        trainer.train()
    except Exception as error:  # the Trainer tells no callback of an exception
        callback.crashed(error)
        raise

run = dynamics.open_run(out / "run.h5")
print("state:", run.status().state)
print("loop:", run.attrs["loop"], "loss rule:", run.attrs["loss_rule"])
print(
    "training loss, first and last:", [round(float(v), 3) for v in run.train_loss().values[[0, -1]]]
)
print("eval_loss:", [round(float(v), 3) for v in run.series("validation")["eval_loss"]])
print("top Hessian eigenvalues:", run.series("hessian")["eigenvalues"][-1].tolist())
# The same page `dynamics report run.h5 -o run.html` writes.
sys.exit(
    dynamics_command(["report", str(out / "run.h5"), "-o", str(out / "run.html"), "--overwrite"])
)
