import math

import pytest
import torch
from scipy.integrate import quad

from dynamics.bias.activations import ACTIVATIONS, ShiftedActivation, expected_activation


def test_expected_shift_matches_closed_forms():
    assert abs(expected_activation("relu") - 1 / math.sqrt(2 * math.pi)) < 1e-6
    assert abs(expected_activation("gelu") - 1 / (2 * math.sqrt(math.pi))) < 1e-6
    assert abs(expected_activation("sigmoid") - 0.5) < 1e-9  # σ(z) − ½ is odd
    assert abs(expected_activation("tanh")) < 1e-12


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_expected_shift_matches_adaptive_integration(name):
    phi = ACTIVATIONS[name]

    def integrand(z: float) -> float:
        value = phi(torch.tensor(z, dtype=torch.float64)).item()
        return value * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)

    reference = quad(integrand, -40, 0)[0] + quad(integrand, 0, 40)[0]
    assert expected_activation(name) == pytest.approx(reference, abs=1e-9)


def test_expected_shift_centres_unit_gaussian_preactivations():
    z = torch.randn(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = ShiftedActivation("relu", "expected")(z)
    assert abs(out.mean().item()) < 4 * out.std().item() / math.sqrt(len(z))


def test_adaptive_shift_zeroes_each_samples_mean_across_neurons():
    x = torch.randn(5, 7, 32) + 0.5
    out = ShiftedActivation("gelu", "adaptive")(x)
    assert torch.allclose(out.mean(dim=-1), torch.zeros(5, 7), atol=1e-6)
    # and only the mean moved: centred outputs are unchanged
    plain = ShiftedActivation("gelu")(x)
    assert torch.allclose(out, plain - plain.mean(dim=-1, keepdim=True))


def test_numeric_shift_and_none():
    x = torch.randn(10)
    assert torch.equal(ShiftedActivation("silu", 0.25)(x), torch.nn.functional.silu(x) - 0.25)
    assert torch.equal(ShiftedActivation("silu")(x), torch.nn.functional.silu(x))


@pytest.mark.parametrize(("name", "shift"), [("softplus", "none"), ("relu", "mean")])
def test_bad_names_are_refused(name, shift):
    with pytest.raises(ValueError):
        ShiftedActivation(name, shift)
