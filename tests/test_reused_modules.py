"""A module called more than once per forward gets one column per call, never their mean."""

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import BiasComponent, DynamicsRecorder, HiddenStateNorms
from dynamics.passes.isolation import in_extra_pass


class ReusedLSTM(pl.LightningModule):
    """An LSTM language model whose one dropout and one ReLU serve the embedding and the
    output, as many LSTM LMs write it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.3)
        self.lstm = nn.LSTM(6, 6, batch_first=True)
        self.head = nn.Linear(6, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.act(self.embed(tokens)))
        h, _ = self.lstm(x)
        return self.head(self.drop(self.act(h)))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        tokens = torch.randint(0, 11, (16, 9), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=8)


def _outputs_of_training_forwards(model: nn.Module, names: list[str]):
    """Each named module's outputs in the training forwards, in call order (extra passes left
    out), caught by hooks of the test's own."""
    seen = {n: [] for n in names}
    modules = dict(model.named_modules())

    def catch(name):
        def hook(module, args, output):
            if not in_extra_pass():
                seen[name].append(output.detach().clone())

        return hook

    return seen, [modules[n].register_forward_hook(catch(n)) for n in names]


def test_each_call_of_a_reused_dropout_and_relu_is_its_own_column(tmp_path, quiet_trainer):
    torch.manual_seed(0)
    model = ReusedLSTM()
    seen, handles = _outputs_of_training_forwards(model, ["drop", "act"])
    probe = HiddenStateNorms(modules=["drop", "act", "lstm"], feature_dim=-1)
    path = tmp_path / "lstm.h5"
    quiet_trainer(max_steps=2, callbacks=[DynamicsRecorder(path, [probe])]).fit(model)
    for handle in handles:
        handle.remove()
    run = open_run(path)
    norms, bias = run.series("hidden_norms"), run.series("activation_bias")
    assert norms.columns["norm"] == ("act#0", "act#1", "drop#0", "drop#1", "lstm")
    assert bias.columns["mean"] == ("act#0", "act#1")
    (settings,) = [p["settings"] for p in run.attrs["probes"] if p["name"] == "hidden"]
    assert settings["calls_per_forward"] == {"act": 2, "drop": 2, "lstm": 1}
    for step in range(2):
        for i in range(2):
            drop, act = seen["drop"][2 * step + i], seen["act"][2 * step + i]
            assert norms["norm"][step][i] == pytest.approx(act.norm(dim=-1).mean().item(), 1e-6)
            assert norms["norm"][step][2 + i] == pytest.approx(
                drop.norm(dim=-1).mean().item(), 1e-6
            )
            assert bias["mean"][step][i] == pytest.approx(act.mean().item(), rel=1e-6)
        # the calls differ, so a mean of them could not pass for either
        assert abs(norms["norm"][step][2] - norms["norm"][step][3]) > 1e-2
    assert not [e for e in run.events() if e.probe == "hidden"]


class Loop(nn.Module):
    """Calls its cell once per extra step it is given: no stable number of calls."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            x = self.cell(x)
        return x


class Looping(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.loop = Loop()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.loop(x, 1 + batch_idx % 2).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)


def test_a_module_whose_call_count_changes_is_refused_with_a_reason(tmp_path, quiet_trainer):
    path = tmp_path / "loop.h5"
    probe = HiddenStateNorms(modules=["loop.cell"], activations=False)
    with pytest.warns(UserWarning, match="loop.cell: called more than 1 times in one forward"):
        quiet_trainer(max_steps=3, callbacks=[DynamicsRecorder(path, [probe])]).fit(Looping())
    run = open_run(path)
    values = run.series("hidden_norms")["norm"][:, 0]
    assert values[0] == values[0] and (values[1:] != values[1:]).all()  # measured, then NaN
    [event] = [e for e in run.events() if e.probe == "hidden"]
    assert event.kind == "warning" and "its columns read NaN from now on" in event.message


def test_bias_component_refuses_a_layer_called_twice(tmp_path, quiet_trainer):
    path = tmp_path / "bias.h5"
    probe = BiasComponent(layers=["act", "embed"])
    with pytest.warns(UserWarning, match="act is called 2 times"):
        quiet_trainer(max_steps=1, callbacks=[DynamicsRecorder(path, [probe])]).fit(ReusedLSTM())
    run = open_run(path)
    assert run.series("bias_component").columns["bias_share"] == ("embed",)
