"""HiddenStateNorms: feature axes per module kind, segment-wise patterns, marked activations."""

import copy

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, HiddenStateNorms
from dynamics.callbacks import module_outputs as module_under_test
from dynamics.callbacks.probe import ProbeUnavailable


class Fittable(pl.LightningModule):
    """A regression module over a fixed, unshuffled dataset: its first batch is known."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__()
        self.data = (x, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self.data), batch_size=16)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.norm(self.conv(x)))


class ResidualCNN(Fittable):
    """Channels, height and width all differ, so a norm over the wrong axis cannot pass."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        super().__init__(torch.randn(32, 1, 5, 7, generator=generator), torch.randn(32))
        self.stem = nn.Conv2d(1, 6, 3, padding=1)
        self.blocks = nn.Sequential(ConvBlock(6), ConvBlock(6), ConvBlock(6))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class CenteredGELU(nn.Module):
    """A hand-written activation: no built-in class, no activation name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) - 0.1


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 16)
        self.act = CenteredGELU()
        self.down = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class CustomActivationMLP(Fittable):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        super().__init__(torch.randn(32, 4, generator=generator), torch.randn(32))
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(F.scaled_dot_product_attention(q, k, v))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.attn = Attention(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.mlp(self.ln(x))


class TinyTransformer(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ChannelsLast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1)


class Scale(nn.Module):
    """A module of no known kind: one parameter, no submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * x


def record_once(probe: HiddenStateNorms, module: nn.Module, *inputs: torch.Tensor):
    """One due step driven by hand: setup, the forward, the step's rows."""
    probe.setup(None, module, None)
    probe.on_step_start(None, module, None, 0)
    with torch.no_grad():
        module(*inputs)
    return probe.on_step_end(None, module, None, None, 0)


def fit_once(tmp_path, quiet_trainer, model: Fittable, probe: HiddenStateNorms):
    path = tmp_path / "run.h5"
    quiet_trainer(max_steps=1, callbacks=[DynamicsRecorder(path, [probe])]).fit(model)
    run = open_run(path)
    (entry,) = [p for p in run.attrs["probes"] if p["class"] == "HiddenStateNorms"]
    return run, entry["settings"]


def test_cnn_norms_run_over_channels_and_average_over_batch_and_positions(tmp_path, quiet_trainer):
    torch.manual_seed(0)
    model = ResidualCNN()
    reference = copy.deepcopy(model)  # θ0, in train mode as the first training forward
    probe = HiddenStateNorms(types=[nn.Conv2d, nn.BatchNorm2d, ConvBlock])
    run, settings = fit_once(tmp_path, quiet_trainer, model, probe)

    outputs = {}
    with torch.no_grad():
        h = outputs["stem"] = reference.stem(reference.data[0][:16])
        for i, block in enumerate(reference.blocks):
            outputs[f"blocks.{i}.conv"] = block.conv(h)
            outputs[f"blocks.{i}.norm"] = block.norm(outputs[f"blocks.{i}.conv"])
            h = outputs[f"blocks.{i}"] = block(h)
    norms = run.series("hidden_norms")
    columns = norms.columns["norm"]
    assert set(columns) == set(outputs)
    expected = [outputs[c].norm(dim=1).mean().item() for c in columns]  # over C; mean N, H, W
    assert norms["norm"][0].tolist() == pytest.approx(expected, rel=1e-5)

    layers = settings["layers"]
    assert layers["stem"] == {"class": "Conv2d", "feature_dim": 1, "rule": "Conv2d output"}
    assert layers["blocks.0.norm"]["feature_dim"] == 1
    # a residual conv block takes the kind of its last normalisation/conv submodule
    assert layers["blocks.0"] == {
        "class": "ConvBlock",
        "feature_dim": 1,
        "rule": "last known submodule norm (BatchNorm2d)",
    }


def test_settings_describe_what_was_recorded(tmp_path, quiet_trainer):
    probe = HiddenStateNorms(types=[nn.Linear], feature_dims={"head": -1})
    _, settings = fit_once(tmp_path, quiet_trainer, ResidualCNN(), probe)
    assert settings["types"] == ["torch.nn.modules.linear.Linear"]
    assert settings["feature_dims"] == {"head": -1} and settings["feature_dim"] is None
    assert settings["layers"] == {
        "head": {"class": "Linear", "feature_dim": -1, "rule": "feature_dims['head']"}
    }
    bias = settings["activation_bias"]
    assert bias["found"] == {f"blocks.{i}.act": "ReLU" for i in range(3)}
    assert bias["looked_at"] == {"ConvBlock": 3, "Conv2d": 4, "BatchNorm2d": 3, "ReLU": 3} | {
        "Sequential": 1,
        "Linear": 1,
    }
    assert "not seen" in bias["functional_calls"]


def test_star_matches_one_segment_and_double_star_any_depth():
    model = TinyTransformer()
    every = [n for n, _ in model.named_modules()]

    def chosen(*patterns):
        probe = HiddenStateNorms(modules=patterns)
        probe.setup(None, model, None)
        probe.teardown()
        return probe.layers

    assert chosen("blocks.*") == ("blocks.0", "blocks.1")
    # the ModuleList itself has no forward, so it is never recorded
    assert chosen("blocks.**") == tuple(n for n in every if n.startswith("blocks."))
    assert len(chosen("blocks.**")) == 18
    assert chosen("blocks.*.attn") == ("blocks.0.attn", "blocks.1.attn")
    assert chosen("**.proj") == ("blocks.0.attn.proj", "blocks.1.attn.proj")
    assert chosen("blocks.?.mlp.[02]") == tuple(
        f"blocks.{i}.mlp.{j}" for i in range(2) for j in (0, 2)
    )
    assert chosen("embed", "head") == ("embed", "head")


def test_transformer_blocks_use_the_last_axis():
    model = TinyTransformer()
    tokens = torch.randint(0, 10, (3, 5))
    probe = HiddenStateNorms(modules=["blocks.*", "embed"])
    rows = record_once(probe, model, tokens)
    with torch.no_grad():
        h = model.embed(tokens)
        expected = [h.norm(dim=-1).mean()]
        for block in model.blocks:
            h = block(h)
            expected.append(h.norm(dim=-1).mean())
    columns = probe.layers
    got = dict(zip(columns, rows["hidden_norms"]["norm"].tolist()))
    assert [got[c] for c in ("embed", "blocks.0", "blocks.1")] == pytest.approx(
        [e.item() for e in expected], rel=1e-5
    )
    assert probe.settings()["layers"]["blocks.0"]["rule"] == ("last known submodule mlp.2 (Linear)")


@pytest.mark.parametrize(
    "marked",
    [{"activation_types": [CenteredGELU]}, {"activation_modules": ["**.act"]}],
    ids=["by type", "by name pattern"],
)
def test_marked_custom_activation_gets_its_bias_recorded(
    tmp_path, quiet_trainer, monkeypatch, marked
):
    printed = []
    monkeypatch.setattr(module_under_test, "rank_zero_info", printed.append)
    torch.manual_seed(0)
    model = CustomActivationMLP()
    reference = copy.deepcopy(model)
    run, settings = fit_once(tmp_path, quiet_trainer, model, HiddenStateNorms(**marked))

    with torch.no_grad():
        expected = reference.body.act(reference.body.up(reference.data[0][:16])).mean().item()
    bias = run.series("activation_bias")
    assert bias.columns["mean"] == ("body.act",)
    assert bias["mean"][0, 0] == pytest.approx(expected, rel=1e-5)
    assert settings["activation_bias"]["found"] == {"body.act": "CenteredGELU"}
    assert settings["activation_bias"]["looked_at"] == {"Linear": 2, "Body": 1, "CenteredGELU": 1}
    (message,) = printed
    assert "body.act" in message and "CenteredGELU ×1" in message and "F.gelu" in message


def test_unknown_activation_is_reported_when_nothing_is_found():
    probe = HiddenStateNorms()
    with pytest.warns(UserWarning, match="found no activation module.*CenteredGELU ×1"):
        probe.setup(None, CustomActivationMLP(), None)
    probe.teardown()
    assert "activation_bias" not in probe.series()


def test_patterns_that_match_nothing_make_the_probe_unavailable():
    model = TinyTransformer()
    probe = HiddenStateNorms(
        modules=["blocks.*", "block.*"],
        activation_modules=["**.acts"],
        activation_types=[CenteredGELU],
    )
    with pytest.raises(ProbeUnavailable) as raised:
        probe.setup(None, model, None)
    message = str(raised.value)
    for named in ("'block.*'", "'**.acts'", "CenteredGELU", "TinyTransformer"):
        assert named in message
    assert "'blocks.*'" not in message
    # nothing is left hooked or declared
    assert probe.series() == {} and probe.layers == ()
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(ProbeUnavailable, match="feature_dims pattern 'mlp'"):
        HiddenStateNorms(modules=["blocks.*"], feature_dims={"mlp": 1}).setup(None, model, None)


def test_state_is_defined_before_setup():
    probe = HiddenStateNorms(modules=["blocks.*"])
    assert probe.series() == {}
    assert probe.settings()["layers"] == {}
    assert probe.settings()["activation_bias"]["found"] == {}


def test_an_axis_contradicting_the_output_is_refused_not_recorded():
    model = nn.Sequential(nn.Sequential(nn.Conv2d(1, 3, 1), ChannelsLast()))
    x = torch.randn(2, 1, 5, 7)
    # the block's last known submodule is a Conv2d, but its output has 5 entries on axis 1
    with pytest.raises(ProbeUnavailable, match=r"0: output of shape \(2, 5, 7, 3\)"):
        record_once(HiddenStateNorms(modules=["0"]), model, x)
    for override in ({"feature_dims": {"*": -1}}, {"feature_dim": 3}):
        rows = record_once(HiddenStateNorms(modules=["0"], **override), model, x)
        expected = model(x).norm(dim=-1).mean().item()
        assert rows["hidden_norms"]["norm"][0].item() == pytest.approx(expected, rel=1e-6)


def test_unknown_kind_uses_the_last_axis_and_says_so():
    model = nn.Sequential(Scale())
    x = torch.randn(2, 3, 4, 5)
    probe = HiddenStateNorms(modules=["0"])
    with pytest.warns(UserWarning, match="0 \\(Scale\\) outputs 4-D tensors"):
        rows = record_once(probe, model, x)
    assert rows["hidden_norms"]["norm"][0].item() == pytest.approx(
        (2 * x).norm(dim=-1).mean().item(), rel=1e-6
    )
    assert probe.settings()["layers"]["0"] == {
        "class": "Scale",
        "feature_dim": -1,
        "rule": "unknown kind: last axis assumed",
    }


def test_arguments_are_checked_at_construction():
    with pytest.raises(TypeError, match="activation_types"):
        HiddenStateNorms(activation_types=[F.gelu])
    with pytest.raises(TypeError, match="modules must be a list"):
        HiddenStateNorms(modules="blocks.*")
    with pytest.raises(TypeError, match="feature_dim"):
        HiddenStateNorms(feature_dim=1.0)


def test_default_choice_skips_losses_and_containers_that_are_never_called():
    model = nn.Module()
    model.net = nn.Linear(3, 3)
    model.heads = nn.ModuleDict({"a": nn.Linear(3, 1), "b": nn.Conv1d(3, 1, 1)})
    model.criterion = nn.MSELoss()
    probe = HiddenStateNorms(activations=False)
    probe.setup(None, model, None)
    probe.teardown()
    assert probe.layers == ("net",)


class _Branchy(nn.Module):
    """``a`` is called once or twice a forward, ``b`` only when asked, ``c`` once."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 5), nn.Linear(3, 5), nn.Linear(5, 5)

    def forward(self, x, twice=False, branch=False):
        h = self.a(x)
        if twice:
            h = h + self.a(2 * x)
        if branch:
            h = h + self.b(x)
        return self.c(h)


def test_a_second_call_setup_did_not_count_is_refused_never_averaged():
    """Set up without a batch the calls cannot be counted: each module has one column, and a
    module called twice in a forward reads NaN from then on, with one note saying why, rather
    than the mean of its calls; a layer not called reads NaN; single calls of one shape equal
    each layer's own mean norm."""
    torch.manual_seed(0)
    model = _Branchy()
    probe = HiddenStateNorms(modules=["a", "b", "c"], activations=False)
    probe.setup(None, model, None)
    assert probe.series()["hidden_norms"]["norm"].columns == ("a", "b", "c")

    def mean_norm(layer, x):
        return torch.linalg.vector_norm(layer(x), dim=-1).mean()

    x = torch.randn(4, 7, 3)
    probe.on_step_start(None, model, None, 0)
    model(x, twice=True)
    [norms] = probe.on_step_end(None, model, None, None, 0)["hidden_norms"].values()
    h = model.a(x) + model.a(2 * x)
    assert torch.isnan(norms[0]) and torch.isnan(norms[1])
    assert norms[2].item() == pytest.approx(mean_norm(model.c, h).item(), rel=1e-6)
    [(_, note)] = probe.pop_notes()
    assert note.startswith("a: called more than 1 times in one forward")

    probe.on_step_start(None, model, None, 1)
    model(x, branch=True)
    [norms] = probe.on_step_end(None, model, None, None, 1)["hidden_norms"].values()
    h = model.a(x) + model.b(x)
    assert torch.isnan(norms[0])  # refused for the rest of the run: no gaps that read as data
    expected = [mean_norm(model.b, x), mean_norm(model.c, h)]
    assert norms[1:].tolist() == pytest.approx(torch.stack(expected).tolist(), rel=1e-6)
    assert probe.pop_notes() == []
    probe.teardown()
