"""dynamics.bias.shift_activations: surgery on any model, c by quadrature, functional calls."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dynamics.bias import shift_activations
from dynamics.bias.activations import ShiftedActivation, expected_value
from dynamics.errors import DynamicsError

PARAMETRISED = [
    nn.ReLU(),
    nn.GELU(),
    nn.GELU(approximate="tanh"),
    nn.SiLU(),
    nn.Sigmoid(),
    nn.Tanh(),
    nn.Mish(),
    nn.ELU(alpha=0.5),
    nn.LeakyReLU(negative_slope=0.2),
    nn.Softplus(beta=2.0, threshold=20.0),
    nn.Softplus(beta=1.0, threshold=1.0),  # the switch to z at 1 is a jump of 0.31
    nn.Softplus(beta=2.0, threshold=3.0),
]


@pytest.mark.parametrize("phi", PARAMETRISED, ids=repr)
def test_quadrature_matches_numerical_integration(phi: nn.Module) -> None:
    integrate = pytest.importorskip("scipy.integrate")

    def integrand(z: float) -> float:
        value = phi(torch.tensor([z], dtype=torch.float64)).item()
        return value * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)

    # Split at the kink (0) and at Softplus's switch so quad sees smooth pieces only.
    cuts = [0.0, *([phi.threshold / phi.beta] if isinstance(phi, nn.Softplus) else [])]
    bounds = [-math.inf, *cuts, math.inf]
    reference = sum(
        integrate.quad(integrand, a, b, epsabs=1e-14, epsrel=1e-13, limit=200)[0]
        for a, b in zip(bounds, bounds[1:], strict=False)
    )
    assert expected_value(phi) == pytest.approx(reference, abs=1e-9)


class ResidualCNN(nn.Module):
    """A torchvision-free ResNet-style CNN: stem, two residual blocks, pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "conv": nn.Conv2d(4, 4, 3, padding=1),
                    "norm": nn.BatchNorm2d(4),
                    "act": nn.ELU(alpha=0.5),
                }
            )
            for _ in range(2)
        )
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block["act"](block["norm"](block["conv"](x)))
        return self.head(x.mean(dim=(2, 3)))


class GPTBlock(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class FunctionalMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 5)
        self.drop = nn.Dropout(0.5)
        self.act = nn.SiLU()
        self.out = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.drop(F.relu(self.body(x)))))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_expected_shift_centres_every_activation_and_keeps_theta0() -> None:
    torch.manual_seed(0)
    model = ResidualCNN()
    before = _snapshot(model)
    table = shift_activations(model, "expected")
    assert [r.module for r in table] == ["stem.2", "blocks.0.act", "blocks.1.act"]
    assert all(r.replaced for r in table)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Monte-Carlo bound: n = 4e6 N(0,1) draws; std of the mean is sd(φ)/2000 < 3e-4 for ReLU
    # and ELU(0.5), so 1e-3 is beyond 3.4 standard errors (and the draw is seeded).
    z = torch.randn(4_000_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for row in table:
        module = model.get_submodule(row.module)
        assert isinstance(module, ShiftedActivation)
        assert row.c == module.constant
        assert abs(module(z).mean().item()) < 1e-3
        assert abs(module.phi(z).mean().item() - row.c) < 1e-3  # the mean did depend on c
    assert table[0].c == pytest.approx(1 / math.sqrt(2 * math.pi), abs=1e-12)
    # A second call leaves the shifted modules (and the φ inside them) alone.
    again = shift_activations(model, 0.5)
    assert [(r.module, r.replaced, r.c, r.note) for r in again] == [
        (r.module, False, r.c, "already shifted") for r in table
    ]


def test_adaptive_shift_is_zero_across_the_channel_dim() -> None:
    torch.manual_seed(0)
    model = ResidualCNN()
    shift_activations(model, "adaptive", dim=1)
    outputs = []
    for m in model.modules():
        if isinstance(m, ShiftedActivation):
            m.register_forward_hook(lambda m, a, out: outputs.append(out))
    model(torch.randn(2, 3, 5, 5))
    assert len(outputs) == 3
    for out in outputs:
        assert out.mean(dim=1).abs().max().item() < 1e-6
        assert out.mean(dim=-1).abs().max().item() > 1e-3  # not centred along another dim


def test_gpt_block_gelu_tanh_shift_and_patterns() -> None:
    torch.manual_seed(0)
    model = GPTBlock()
    with pytest.raises(DynamicsError, match="match no module"):
        shift_activations(model, include=["nothing.*"])
    table = shift_activations(model, 0.25, exclude=["**"])
    assert [(r.module, r.replaced, r.note) for r in table] == [
        ("mlp.1", False, "excluded by pattern")
    ]
    table = shift_activations(model, include=["mlp.*"])
    (row,) = table
    assert row.c == expected_value(nn.GELU(approximate="tanh"))
    x = torch.randn(2, 3, 8)
    h = model.mlp[0](x)
    expected = F.gelu(h, approximate="tanh") - row.c
    assert torch.allclose(model.mlp[1](h), expected, atol=1e-6)
    assert "mlp.1" in str(table) and "GELU(approximate='tanh')" in str(table)


def test_functional_call_listed_with_its_module_path_and_state_restored() -> None:
    torch.manual_seed(0)
    model = FunctionalMLP().train()
    model.out.eval()
    x = torch.randn(4, 3)
    rng = torch.get_rng_state()
    table = shift_activations(model, "expected", example_input=x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and model.drop.training and not model.out.training
    rows = {(r.module, r.activation): r for r in table}
    assert rows[("act", "SiLU()")].replaced
    functional = [r for r in table if not r.replaced]
    # F.relu is called in the model's own forward; SiLU's internal F.silu is not reported.
    assert [(r.module, r.activation, r.note) for r in functional] == [
        ("", "F.relu", "not replaced (functional call at <model>)")
    ]


def test_shared_activation_module_is_shifted_at_every_path() -> None:
    act = nn.Tanh()
    model = nn.Sequential(nn.Linear(2, 2), act, nn.Linear(2, 2), act)
    table = shift_activations(model, 0.5)
    assert [r.module for r in table] == ["1", "3"]
    x = torch.randn(3, 2)
    assert torch.equal(model[1](x), torch.tanh(x) - 0.5)
    assert torch.equal(model[3](x), torch.tanh(x) - 0.5)


def test_custom_module_with_declared_phi() -> None:
    class Square(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x

    model = nn.Sequential(nn.Linear(2, 2), Square())
    (row,) = shift_activations(model, custom={"1": lambda z: z * z})
    assert row.replaced and row.c == pytest.approx(1.0, abs=1e-12)  # E[z²] = 1
    x = torch.randn(3, 2)
    assert torch.allclose(model[1](x), x * x - 1.0)
