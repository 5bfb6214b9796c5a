"""The character transformer and its standard-library text (used by the recording benchmark)."""

import math

import pytest
import torch

from dynamics.experiments.char_gpt.data import StdlibTextData, stdlib_text
from dynamics.experiments.char_gpt.model import CharGPT
from dynamics.experiments.char_gpt.module import CharGPTModule


def test_training_and_heldout_text_come_from_different_files():
    train, heldout = stdlib_text(False, 200_000), stdlib_text(True, 20_000)
    assert len(train) == 200_000 and len(heldout) == 20_000
    # A held-out window never occurs verbatim in the training text read here.
    assert heldout[5000:5200].tobytes() not in train.tobytes()


def test_output_at_a_position_depends_only_on_earlier_tokens():
    model = CharGPT(context=16, width=16, depth=1, heads=2).eval()
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[0, :10], model(changed)[0, :10])
        assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:])


def test_bits_per_character_is_the_loss_in_bits(quiet_trainer):
    module = CharGPTModule(context=16, width=16, depth=1, heads=2)
    data = StdlibTextData(context=16, batch_size=4, train_bytes=50_000, heldout_windows=8)
    trainer = quiet_trainer(
        max_steps=3, val_check_interval=3, check_val_every_n_epoch=None, num_sanity_val_steps=0
    )
    trainer.fit(module, data)
    metrics = module.trainer.callback_metrics
    assert metrics["val_bpc"].item() == pytest.approx(metrics["val_loss"].item() / math.log(2))
    assert metrics["val_loss"].item() < math.log(256)  # three steps already beat uniform bytes
