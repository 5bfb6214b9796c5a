"""Padded positions are left out of every per-position statistic, or the module is refused."""

import pytest
import torch
from torch import nn

from dynamics.callbacks import HiddenStateNorms


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 5)
        self.up = nn.Linear(5, 6)
        self.act = nn.ReLU()
        self.pool = nn.Linear(6, 2)

    def forward(self, batch):
        h = self.act(self.up(self.embed(batch["input_ids"])))
        return self.pool(h.mean(1)), h


def _step(probe, model, batch):
    probe.on_step_start(None, model, batch, 0)
    with torch.no_grad():
        outputs = model(batch)
    probe.on_micro_batch_end(None, model, batch, None, 0)
    return probe.on_step_end(None, model, batch, None, 0), outputs


def _batch():
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    return {"input_ids": torch.randint(0, 7, (3, 4), generator=generator), "attention_mask": mask}


def test_dead_units_and_nonfinite_values_are_counted_over_real_positions():
    torch.manual_seed(0)
    model = Tokens()
    batch = _batch()
    real = batch["attention_mask"].bool()
    # unit 0 is 10·e₀ − 1, e₀ the embedding's first feature: 1 for token 0 (the padding
    # token), 0 for every other: alive at padded positions only, dead over the real ones
    batch["input_ids"][~real] = 0
    batch["input_ids"][real] = batch["input_ids"][real].clamp(min=1)
    with torch.no_grad():
        model.embed.weight[:, 0] = 0.0
        model.embed.weight[0, 0] = 1.0
        model.up.weight[0] = 0.0
        model.up.weight[0, 0] = 10.0
        model.up.bias[0] = -1.0
    probe = HiddenStateNorms(modules=["up", "pool"], unit_health=True)
    probe.setup(None, model, None)
    rows, (_, h) = _step(probe, model, batch)
    health = rows["unit_health"]
    dead_real = (h[real].amax(0) == 0).float().mean()
    dead_all = (h.reshape(-1, 6).amax(0) == 0).float().mean()
    assert dead_real != dead_all  # the padding would hide a dead unit
    assert health["dead"][0] == dead_real
    up = model.up(model.embed(batch["input_ids"]))
    expected = up.norm(dim=-1)[real].mean()
    assert rows["hidden_norms"]["norm"][0].item() == pytest.approx(expected.item(), rel=1e-6)
    # the pooled output has no positions: its one row per sample is not masked
    pooled = model(batch)[0].norm(dim=-1).mean()
    assert rows["hidden_norms"]["norm"][1].item() == pytest.approx(pooled.item(), rel=1e-6)
    assert probe.settings()["mask"] == "batch['attention_mask'] where a dict batch has one"


def test_an_output_whose_positions_do_not_line_up_with_the_mask_is_refused():
    class Transposed(nn.Module):
        def forward(self, x):
            return x.transpose(0, 1)  # (positions, batch, features)

    model = nn.Sequential()
    model.embed = nn.Embedding(7, 5)
    model.flip = Transposed()
    probe = HiddenStateNorms(modules=["flip"], feature_dim=-1, activations=False)
    probe.setup(None, model, None)
    batch = _batch()
    probe.on_step_start(None, model, batch, 0)
    model(batch["input_ids"])
    probe.on_micro_batch_end(None, model, batch, None, 0)
    norms = probe.on_step_end(None, model, batch, None, 0)["hidden_norms"]["norm"]
    assert torch.isnan(norms).all()
    [(_, note)] = probe.pop_notes()
    assert "flip: values per position of shape (4, 3) do not start with the mask's" in note


def test_accumulated_micro_batches_pool_their_real_positions():
    """Two micro-batches with different padding: one mean over all their real positions (not
    the mean of the two means); unit health, which needs the mask during the forward, reads NaN
    for the step with a note, since a later micro-batch's mask is not known then."""
    torch.manual_seed(0)
    model = Tokens()
    first, second = _batch(), _batch()
    second["attention_mask"] = torch.ones(3, 4, dtype=torch.long)
    probe = HiddenStateNorms(modules=["up"], unit_health=True)
    probe.setup(None, model, None)
    with torch.no_grad():  # by hand, before the probe is armed
        norms = [
            model.up(model.embed(b["input_ids"])).norm(dim=-1)[b["attention_mask"].bool()]
            for b in (first, second)
        ]
    probe.on_step_start(None, model, first, 0)
    for batch in (first, second):
        with torch.no_grad():
            model(batch)
        probe.on_micro_batch_end(None, model, batch, None, 0)
    rows = probe.on_step_end(None, model, second, None, 0)
    pooled = torch.cat(norms).mean()
    assert rows["hidden_norms"]["norm"][0].item() == pytest.approx(pooled.item(), rel=1e-6)
    assert abs(pooled - (norms[0].mean() + norms[1].mean()) / 2) > 1e-3
    assert torch.isnan(rows["unit_health"]["dead"]).all()
    assert any("later micro-batch's mask is not known" in note for _, note in probe.pop_notes())
