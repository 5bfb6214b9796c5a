"""One tiny ``GPT2LMHeadModel`` (from a config, nothing downloaded), its padded token data and
its optimizer, shared by the tests that train it through each loop (Lightning, the Hugging Face
Trainer, accelerate, a plain loop): the same model, data order, seed and optimizer everywhere.

Dropout is off, so no loop's use of the random generator can make the runs differ; batches
come in a fixed order (the Hugging Face Trainer shuffles unless told otherwise).
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, SequentialSampler
from transformers import GPT2Config, GPT2LMHeadModel, Trainer

VOCAB = 48
LR = 1e-2
BATCH = 4


def config() -> GPT2Config:
    return GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=VOCAB,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=0,
    )


def model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config())


def examples(count: int = 32, seed: int = 1) -> list[dict[str, list[int]]]:
    """Token sequences of 5 to 12 tokens: padded batches differ in their padding."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 13, (count,), generator=generator).tolist()
    return [
        {"input_ids": torch.randint(1, VOCAB, (n,), generator=generator).tolist()} for n in lengths
    ]


def collate(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, its ``attention_mask``, and ``labels`` with -100 at pads."""
    longest = max(len(e["input_ids"]) for e in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, example in enumerate(batch):
        tokens = torch.tensor(example["input_ids"])
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loader(count: int = 32, batch_size: int = BATCH) -> DataLoader:
    return DataLoader(examples(count), batch_size=batch_size, shuffle=False, collate_fn=collate)


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    """Plain AdamW without weight decay: what the Hugging Face Trainer builds by default
    (``weight_decay=0``), in one parameter group."""
    return torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)


def loss(net: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss function of the plain and accelerate loops: the model's own."""
    return net(**batch).loss


class InOrderTrainer(Trainer):
    """The Hugging Face Trainer taking its training data in order, as the other loops do."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


class LightningGPT2(pl.LightningModule):
    """The same model and optimizer as a LightningModule."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.model = model(seed)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, batch_size=len(batch["input_ids"]))

    def configure_optimizers(self):
        return optimizer(self.model)
