"""The same run through four training loops: how far each loop's run file is from Lightning's.

    python benchmarks/bench_loop_agreement.py [--steps 6]

Trains the tiny GPT-2 of ``tests/tiny_gpt2.py`` (from a config, padded dict batches, dropout
off, batches in order, AdamW) through Lightning, the Hugging Face Trainer, accelerate and a
plain loop, each recorded with the same probes, and each once more without the recorder. It
prints, for every recorded series, the largest absolute difference from Lightning's file, and
for every loop whether its training is bit-identical with and without the recorder and to
Lightning's.

The Trainer runs here on the arithmetic the Lightning module trains on (its loss: the model's
own causal-LM mean, ``model.loss_type = "ForCausalLM"``; its optimizer: the same AdamW). With
its own defaults it trains on another loss (the token sum over a count that includes the first
position) with a fused AdamW, and its files differ from Lightning's by what that changes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from accelerate import Accelerator
from transformers import TrainingArguments

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dynamics  # noqa: E402
from dynamics.callbacks import (  # noqa: E402
    DynamicsRecorder,
    HessianSpectrum,
    HiddenStateNorms,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.integrations.huggingface import DynamicsCallback  # noqa: E402
from tests import tiny_gpt2  # noqa: E402

Parameters = dict[str, torch.Tensor]


def probes() -> list:
    return [
        TrainingLoss(),
        HiddenStateNorms(),
        ParameterDisplacement(),
        HessianSpectrum(k=2, every_n_steps=3),
    ]


def lightning(path: Path | None, steps: int) -> Parameters:
    module = tiny_gpt2.LightningGPT2()
    callbacks = [DynamicsRecorder(path, probes())] if path else []
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, tiny_gpt2.loader())
    return _parameters(module.model)


def huggingface(path: Path | None, steps: int) -> Parameters:
    model = tiny_gpt2.model()
    model.loss_type = "ForCausalLM"  # the model's own mean, as the other loops train on
    with tempfile.TemporaryDirectory() as folder:
        arguments = TrainingArguments(
            output_dir=folder,
            use_cpu=True,
            report_to=[],
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            learning_rate=tiny_gpt2.LR,
            weight_decay=0.0,
            per_device_train_batch_size=tiny_gpt2.BATCH,
            max_steps=steps,
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = tiny_gpt2.InOrderTrainer(
            model=model,
            args=arguments,
            train_dataset=tiny_gpt2.examples(),
            data_collator=tiny_gpt2.collate,
            callbacks=[DynamicsCallback(path, probes())] if path else [],
            optimizers=(tiny_gpt2.optimizer(model), None),
        )
        trainer.train()
    return _parameters(model)


def plain(path: Path | None, steps: int) -> Parameters:
    model = tiny_gpt2.model()
    optimizer = tiny_gpt2.optimizer(model)
    batches = _batches(tiny_gpt2.loader(), steps)
    if path is None:
        for batch in batches:
            tiny_gpt2.loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        return _parameters(model)
    # The run's length, which Lightning and the Trainer know from max_steps: the displacement's
    # snapshot plan is laid out on it.
    recorder = dynamics.record(
        path, model, optimizer, loss_fn=tiny_gpt2.loss, probes=probes(), expected_steps=steps
    )
    with recorder as rec:
        for batch in batches:
            with rec.batch(batch) as step:
                loss = tiny_gpt2.loss(model, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step.loss(loss)
    return _parameters(model)


def accelerated(path: Path | None, steps: int) -> Parameters:
    accelerator = Accelerator(cpu=True)
    net = tiny_gpt2.model()
    model, optimizer, loader = accelerator.prepare(
        net, tiny_gpt2.optimizer(net), tiny_gpt2.loader()
    )
    batches = _batches(loader, steps)
    if path is None:
        for batch in batches:
            accelerator.backward(tiny_gpt2.loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        return _parameters(accelerator.unwrap_model(model))
    recorder = dynamics.record(
        path,
        model,
        optimizer,
        loss_fn=tiny_gpt2.loss,
        probes=probes(),
        accelerator=accelerator,
        expected_steps=steps,
    )
    with recorder as rec:
        for batch in batches:
            with accelerator.accumulate(model), rec.batch(batch) as step:
                loss = tiny_gpt2.loss(model, batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step.loss(loss)
    return _parameters(accelerator.unwrap_model(model))


LOOPS = {
    "lightning": lightning,
    "huggingface": huggingface,
    "accelerate": accelerated,
    "plain": plain,
}


def _batches(loader, steps: int) -> list:
    batches = list(loader)
    return [batches[i % len(batches)] for i in range(steps)]


def _parameters(model: torch.nn.Module) -> Parameters:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(a: Parameters, b: Parameters) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _series(path: Path) -> dict[str, np.ndarray]:
    """Every recorded series (and the end vectors) of a run file, by ``group/series``."""
    run = dynamics.open_run(path)
    values = {}
    for group in run.groups:
        series = run.series(group)
        values[f"{group}/step"] = np.asarray(series.step, dtype=np.float64)
        values |= {f"{group}/{n}": np.asarray(v, np.float64) for n, v in series.values.items()}
    for vector in ("theta0", "theta_final"):
        values[vector] = np.asarray(run.vector(vector), dtype=np.float64)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    steps = parser.parse_args().steps
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        trained, files = {}, {}
        for loop, train in LOOPS.items():
            files[loop] = Path(folder) / f"{loop}.h5"
            trained[loop] = train(files[loop], steps)
            bare = train(None, steps)
            print(
                f"{loop:12s} training with the recorder == without: "
                f"{_same(trained[loop], bare)}; == Lightning's: "
                f"{_same(trained[loop], trained['lightning'])}"
            )
        reference = _series(files["lightning"])
        print(f"\nlargest |difference| from Lightning's file, {steps} steps:")
        print(f"{'series':44s}" + "".join(f"{loop:>14s}" for loop in LOOPS if loop != "lightning"))
        others = {loop: _series(files[loop]) for loop in LOOPS if loop != "lightning"}
        for key, values in reference.items():
            cells = []
            for series in others.values():
                other = series.get(key)
                if other is None or other.shape != values.shape:
                    cells.append("missing")
                else:
                    cells.append(f"{np.nanmax(np.abs(other - values), initial=0.0):.2g}")
            print(f"{key:44s}" + "".join(f"{cell:>14s}" for cell in cells))


if __name__ == "__main__":
    main()
