"""The controlled experiment's model: the paper's pre-norm residual MLP stack (a transformer's
blocks with attention and head stripped)."""

from __future__ import annotations

import torch
from torch import nn

from dynamics.bias.activations import ShiftedActivation


class ResidualBlock(nn.Module):
    """h ← h + W_down φ(W_up LN(h))."""

    def __init__(self, width: int, expansion: int, activation: ShiftedActivation, bias: bool):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width * expansion, bias=bias)
        self.act = activation
        self.down = nn.Linear(width * expansion, width, bias=bias)

        # N(0, 1/fan_in) weights and zero biases make the pre-activations W_up LN(h) exactly
        # N(0, 1) per unit at initialization, the distribution the fixed shift c = E[φ(z)] is
        # computed for (PyTorch's default would give variance 1/3, and c would overshoot).
        for linear in (self.up, self.down):
            nn.init.normal_(linear.weight, std=linear.in_features**-0.5)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.act(self.up(self.norm(h))))


class ResidualMLP(nn.Module):
    """A stack of :class:`ResidualBlock` on a residual stream of ``width`` features.

    Example::

        mlp = ResidualMLP(width=64, depth=4, activation="relu", shift="expected")
        mlp(torch.randn(8, 64)).shape  # (8, 64)

    Args:
        width: residual-stream width (input and output size).
        expansion: hidden width of each block is ``width * expansion``.
        depth: number of blocks.
        activation: activation name (see ``dynamics.bias.activations.ACTIVATIONS``).
        shift: activation shift (``none``, ``expected``, ``adaptive`` or a number).
        bias: whether the linear layers carry biases.
    """

    def __init__(
        self,
        width: int = 64,
        expansion: int = 4,
        depth: int = 4,
        activation: str = "relu",
        shift: str | float = "none",
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            ResidualBlock(width, expansion, ShiftedActivation(activation, shift), bias)
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def parameter_count(**architecture) -> int:
    """The parameters of a :class:`ResidualMLP` of ``architecture``, counted without allocating
    them (built on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in ResidualMLP(**architecture).parameters())
