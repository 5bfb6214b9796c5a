"""dynamics.bias.auditing against counts, closed forms and direct evaluation on small models."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dynamics.bias import AuditResult, audit
from dynamics.bias.auditing import audit_batch, forward_input
from dynamics.errors import DynamicsError


def seed_mlp(bias: bool = True, activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """Seed 000's 784-512-256-128-10 MLP."""
    widths = [784, 512, 256, 128, 10]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(a, b, bias=bias)] + ([activation()] if i < 3 else [])
    return nn.Sequential(*layers)


def state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def layer(result: AuditResult, module: str):
    return next(row for row in result.layers if row.module == module)


def test_seed_000_mlp_bias_share_is_906_of_567434():
    result = audit(seed_mlp())
    assert result.share() == "906 of 567,434 = 0.16 %"
    assert result.lines()[0] == "bias parameters: 906 of 567,434 = 0.16 %"
    widths = [784, 512, 256, 128, 10]
    assert [(r.bias, r.total) for r in result.parameters] == [
        (b, (a + 1) * b) for a, b in zip(widths, widths[1:])
    ]
    assert not result.bias_free


def test_bias_free_relu_mlp_pins_the_origin_without_touching_the_model():
    model, x = seed_mlp(bias=False).train(), torch.randn(4, 784)
    before, rng = state(model), torch.get_rng_state()
    result = audit(model, x, draws=3)
    assert result.bias_free and result.share() == "0 of 566,528 = 0.00 %"
    assert result.origin.checked and result.origin.draws == 3
    assert result.origin.pinned and result.origin.largest_norm == 0.0
    assert "in all 3 random weight draws" in result.origin.note
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(m.training for m in model.modules())
    # Every layer lost its bias and nothing supplies a shift: all flagged, as seed 000 argues.
    assert [row.flagged for row in result.layers] == [True] * 4


@pytest.mark.parametrize(
    "model",
    [seed_mlp(bias=False, activation=nn.Sigmoid), seed_mlp(bias=True)],
    ids=["bias-free sigmoid", "with biases"],
)
def test_origin_moves_with_sigmoid_or_biases(model):
    origin = audit(model, torch.randn(2, 784), draws=2).origin
    assert origin.checked and origin.pinned is False and origin.largest_norm > 0


def test_origin_of_an_lstm_follows_its_biases():
    x = torch.randn(3, 2, 4)
    assert audit(nn.LSTM(4, 6, bias=False), x).origin.pinned
    assert audit(nn.LSTM(4, 6), x).origin.pinned is False


def test_origin_is_not_checked_on_token_ids_or_without_input():
    embed = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    traced, registered = audit(embed, torch.tensor([[1, 2]])), audit(embed)
    assert not traced.origin.checked and "token ids have no origin" in traced.origin.note
    assert "no example input" in registered.origin.note
    # The embedding reads the input, in either order: the linear reads a hidden state.
    assert layer(traced, "1").absorbable is False and layer(registered, "1").absorbable is False


def test_origin_check_leaves_batchnorm_buffers_and_mode_alone():
    model = nn.Sequential(nn.Conv2d(1, 2, 3, bias=False), nn.BatchNorm2d(2), nn.ReLU()).train()
    before = state(model)
    audit(model, torch.randn(4, 1, 5, 5))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model[1].training


def test_absorption_exact_only_at_the_input():
    result = audit(seed_mlp(), torch.randn(2, 784))
    assert [row.absorbable for row in result.layers] == [True, False, False, False]
    # Zero padding makes a constant channel 0 at the borders: not exact.
    padded = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 3))
    x = torch.randn(1, 1, 6, 6)
    assert layer(audit(padded, x), "0").absorbable is False
    valid = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 2, 3))
    assert [row.absorbable for row in audit(valid, x).layers] == [True, False]


def test_batchnorm_supplies_the_shift_but_not_after_an_inplace_relu():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, bias=False),
        nn.ReLU(inplace=True),  # the BatchNorm after it normalizes ReLU's output, not the conv's
        nn.BatchNorm2d(4),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(4 * 6 * 6, 5, bias=False),
        nn.BatchNorm1d(5),
    )
    result = audit(model, torch.randn(2, 3, 8, 8))
    assert (layer(result, "0").shift_source, layer(result, "0").flagged) == ("1", False)
    assert layer(result, "3").flagged and layer(result, "3").followed_by == ("4",)
    # Flatten (a view) and dropout (a mask, no shift) are passed through.
    assert layer(result, "8").shift_source == "9"


class PreNormBlock(nn.Module):
    """A GPT-style block without biases: LayerNorm, SDPA attention, residual adds, F.gelu."""

    def __init__(self, width: int = 8, heads: int = 2, norm_bias: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, bias=norm_bias)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.ln2 = nn.LayerNorm(width, bias=norm_bias)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)
        self.q_norm = nn.LayerNorm(width, bias=norm_bias)
        self.key = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = (
            z.view(b, t, self.heads, w // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(w, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return self.q_norm(self.key(x))  # a normalization right after a bias-free layer


def test_transformer_block_traced_data_flow():
    result = audit(PreNormBlock(), torch.randn(2, 5, 8))
    # The residual add between proj and ln2 is functional: ln2 normalizes x + proj(y).
    assert layer(result, "proj").flagged and layer(result, "proj").followed_by == ()
    assert layer(result, "qkv").flagged and layer(result, "up").flagged
    assert layer(result, "key").shift_source == "q_norm"
    assert "not be exactly redundant" in layer(result, "key").note
    assert [(a.module, a.activation, a.measured) for a in result.activations] == [
        ("", "F.gelu", None)
    ]
    assert not result.origin.pinned  # LayerNorm's learned shifts move the origin
    without_shift = audit(PreNormBlock(norm_bias=False), torch.randn(2, 5, 8))
    assert layer(without_shift, "key").flagged
    assert "has no learned shift" in layer(without_shift, "key").note
    assert without_shift.origin.pinned  # bias-free, and GELU(0) = LN(0) = 0


class Reordered(nn.Module):
    """Registered in another order than called: registration would say conv is followed by
    nothing, and the linear by the BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2 * 4 * 4, 3, bias=False)
        self.norm = nn.BatchNorm2d(2)
        self.conv = nn.Conv2d(1, 2, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)).flatten(1))


def test_followed_by_is_the_traced_forward_not_the_registration_order():
    traced = audit(Reordered(), torch.randn(2, 1, 4, 4))
    assert traced.order.startswith("traced")
    assert layer(traced, "conv").shift_source == "norm" and layer(traced, "head").flagged
    registered = audit(Reordered())
    assert registered.order.startswith("registration")
    assert layer(registered, "head").shift_source == "norm"  # what the order alone suggests


def test_activation_bias_expected_and_measured():
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 16), nn.ELU(alpha=0.5))
    x = torch.randn(64, 3)
    result = audit(model, x)
    relu, elu = result.activations
    assert relu.expected == pytest.approx(1 / math.sqrt(2 * math.pi), abs=1e-12)
    # E[ELU_α(z)] = E[z; z>0] + α E[e^z − 1; z<0] = φ(0) + α (e^{1/2} Φ(−1) − 1/2).
    phi_minus_1 = 0.5 * math.erfc(1 / math.sqrt(2))
    closed = 1 / math.sqrt(2 * math.pi) + 0.5 * (math.exp(0.5) * phi_minus_1 - 0.5)
    assert elu.expected == pytest.approx(closed, abs=1e-12)
    with torch.no_grad():
        hidden = F.relu(model[0](x))
        assert relu.measured == pytest.approx(hidden.double().mean().item(), rel=1e-12)
        out = F.elu(model[2](hidden), alpha=0.5)
        assert elu.measured == pytest.approx(out.double().mean().item(), rel=1e-12)


def test_a_reused_activation_says_its_calls_are_pooled():
    class Reused(nn.Module):
        """One ReLU after both layers: its measured mean pools two calls of other means."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.act = nn.Linear(3, 8), nn.Linear(8, 4), nn.ReLU()

        def forward(self, x):
            return self.act(self.fc2(self.act(self.fc1(x))))

    model, x = Reused(), torch.randn(32, 3)
    (row,) = audit(model, x).activations
    with torch.no_grad():
        first = F.relu(model.fc1(x)).double()
        second = F.relu(model.fc2(first.float())).double()
    pooled = (first.sum() + second.sum()) / (first.numel() + second.numel())
    assert abs(first.mean() - second.mean()) > 1e-3  # a per-call mean could not pass
    assert row.measured == pytest.approx(pooled.item(), rel=1e-12)
    assert "called 2 times in one forward" in row.note
    (single,) = audit(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), x).activations
    assert "called" not in single.note


def test_functional_activations_are_listed_not_measured():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return F.relu(self.fc(x))

    (row,) = audit(Functional(), torch.randn(2, 3)).activations
    assert (row.activation, row.measured, row.expected) == ("F.relu", None, None)
    assert "functional call" in row.note


def test_dict_round_trip_through_json():
    result = audit(seed_mlp(bias=False), torch.randn(2, 784))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["share"] == "0 of 566,528 = 0.00 %" and data["bias_free"]
    assert AuditResult.from_dict(data) == result


def test_bad_input_one_clear_error():
    with pytest.raises(DynamicsError, match="draws must be at least 1"):
        audit(seed_mlp(), draws=0)
    with pytest.raises(DynamicsError, match="on the example input failed: RuntimeError"):
        audit(seed_mlp(), torch.randn(2, 5))


def test_forward_input_is_what_the_training_step_passes_to_forward(small_cnn):
    module = small_cnn()
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))
    assert forward_input(module, (x, y)) == ("", x)
    first = layer(audit(module, x), "features.0")
    assert first.absorbable is False and "zero padding" in first.note
    assert first.note.endswith("redundant: features.1 removes any per-channel constant")


def test_forward_input_finds_the_network_a_loss_calls():
    from dynamics.experiments.teacher_student import TeacherStudentModule

    module = TeacherStudentModule(width=8, expansion=2, depth=1)
    x = torch.randn(4, 8)
    path, given = forward_input(module, (x, torch.zeros(4, 8)))
    assert (path, given) == ("student", x)
    result = audit_batch(module, (x, torch.zeros(4, 8)), source="a batch")
    assert result.input_note == "a batch, into student, which holds all the parameters"
    held = sum(p.numel() for p in module.parameters())
    assert result.order.startswith("traced") and result.total_parameters == held == 296


class EncoderHead(nn.Module):
    """A loss pass that calls two networks in turn: no one network holds every parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def dynamics_loss(self, batch):
        return self.head(self.encoder(batch)).sum()


def test_audit_batch_refuses_to_trace_part_of_a_model():
    result = audit_batch(EncoderHead(), torch.randn(2, 3))
    assert result.order.startswith("registration") and result.total_parameters == 26
    assert "encoder first, which holds 16 of the module's 26 parameters" in result.input_note


def test_tied_weights_count_once():
    from dynamics.models import CharGPT

    model = CharGPT(context=8, width=16, depth=1)
    assert model.head.weight is model.tokens.weight
    result = audit(model, torch.randint(0, 256, (2, 8)))
    assert result.total_parameters == sum(p.numel() for p in model.parameters()) == 7536
    assert "head" not in [row.module for row in result.parameters]  # its one weight is tied
    assert layer(result, "head").flagged  # the layer is still there, without a bias


def test_the_redundancy_notes_hold_by_direct_evaluation():
    """BatchNorm removes a per-channel bias before it exactly; LayerNorm only its mean."""
    torch.manual_seed(0)
    x, b = torch.randn(8, 6), torch.randn(4)
    linear = nn.Linear(6, 4, bias=False)
    for norm, exact in ((nn.BatchNorm1d(4).train(), True), (nn.LayerNorm(4), False)):
        with torch.no_grad():
            same = torch.allclose(norm(linear(x) + b), norm(linear(x)), atol=1e-5)
        assert same is exact
        result = audit(nn.Sequential(linear, norm), x)
        assert layer(result, "0").shift_source == "1"
        assert ("not be exactly redundant" in layer(result, "0").note) is not exact


def test_attention_biases_count_by_name_and_the_layer_reads_its_input():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x)[0]

    result = audit(Attention(), torch.randn(2, 3, 8))
    # in_proj_bias (3 × 8) and out_proj.bias (8): every parameter named *bias.
    assert [(r.module, r.bias) for r in result.parameters] == [("attn", 24), ("attn.out_proj", 8)]
    (row,) = result.layers  # out_proj is the attention's own, called functionally inside it
    assert row.module == "attn" and row.bias and row.absorbable is False
    assert "input projection's bias only" in row.note
