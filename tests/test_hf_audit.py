"""The bias audit of a Hugging Face model, whose forward takes keyword arguments (issue 22,
item 7): ``BiasAudit`` follows the training step's ``self.model(input_ids=...)`` call, ``dynamics
audit`` takes the arguments as ``--input-json`` or an example batch file, and an embedding
model given only ``--input-shape`` is told to pass ``--vocab``.
"""

from __future__ import annotations

import json

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from dynamics import open_run
from dynamics.analysis.measures.bias_audit import recorded_audit
from dynamics.bias.auditing import audit
from dynamics.callbacks import BiasAudit, DynamicsRecorder
from dynamics.cli import main
from dynamics.params.batch_tree import ForwardArguments
from tests.conftest import make_quiet_trainer

SCRIPT = """
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_gpt2():
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    return GPT2LMHeadModel(config)
"""
IDS = [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(SCRIPT)
    return f"{path}:tiny_gpt2"


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_audit_takes_keyword_arguments_as_json_or_a_file(script, tmp_path, capsys):
    code, out, err = cli(
        capsys, "audit", script, "--input-json", json.dumps({"input_ids": IDS}), "--json"
    )
    assert code == 0, err
    from_json = json.loads(out)
    assert from_json["order"].startswith("traced forward")
    assert from_json["input_note"] == "keyword arguments input_ids (--input-json)"
    torch.save({"input_ids": torch.tensor(IDS)}, tmp_path / "batch.pt")
    code, out, err = cli(capsys, "audit", script, "--input-file", tmp_path / "batch.pt", "--json")
    assert code == 0, err
    from_file = json.loads(out)
    assert from_file.pop("input_note") == f"{tmp_path / 'batch.pt'} (--input-file)"
    from_json.pop("input_note")
    assert from_file == from_json
    # The same as the library's audit of the model called as model(input_ids=ids).
    torch.manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8))
    direct = audit(model, ForwardArguments((), {"input_ids": torch.tensor(IDS)})).to_dict()
    assert json.loads(json.dumps(direct["layers"])) == from_json["layers"]
    assert from_json["total_parameters"] == sum(p.numel() for p in model.parameters())


def test_an_embedding_model_without_vocab_is_told_to_pass_it(script, capsys):
    code, _, err = cli(capsys, "audit", script, "--input-shape", "2,8")
    assert code == 2 and err.count("\n") == 1, err
    assert "reads token ids" in err and "transformer.wte" in err and "--vocab 16" in err
    code, _, err = cli(capsys, "audit", script, "--input-shape", "2,8", "--vocab", "16")
    assert code == 0, err
    code, _, err = cli(capsys, "audit", script, "--input-shape", "2,8", "--input-json", "[1]")
    assert code == 2 and "--input-shape and --input-json: give one example input" in err


class LanguageModel(pl.LightningModule):
    """A GPT-2 trained on dict batches: its step calls ``self.model(input_ids=..., labels=...)``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader([{"input_ids": torch.tensor(row)} for row in IDS], batch_size=2)


def test_bias_audit_traces_a_forward_called_with_keywords(tmp_path):
    torch.manual_seed(0)
    module = LanguageModel()
    make_quiet_trainer(
        max_steps=1,
        callbacks=[DynamicsRecorder(tmp_path / "lm.h5", [BiasAudit()])],
    ).fit(module)
    run = open_run(tmp_path / "lm.h5")
    assert list(run.events()) == []
    recorded = recorded_audit(run)
    assert recorded.order.startswith("traced forward")
    assert recorded.input_note.endswith("into model, which holds all the parameters")
    assert [row.module for row in recorded.layers] == ["lm_head"]
