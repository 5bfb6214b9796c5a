"""The models the experiments train: the paper's pre-norm residual MLP stack (attention and head
stripped) and a nanoGPT-style character transformer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dynamics.activations import ShiftedActivation


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

    Args:
        width: residual-stream width (input and output size).
        expansion: hidden width of each block is ``width * expansion``.
        depth: number of blocks.
        activation: activation name (see ``dynamics.activations.ACTIVATIONS``).
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


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = (
            t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, width))


class GPTBlock(nn.Module):
    """Pre-LN transformer block: h ← h + attn(LN(h)); h ← h + W_down φ(W_up LN(h))."""

    def __init__(self, width: int, heads: int, activation: ShiftedActivation) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = activation
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h))
        return h + self.down(self.act(self.up(self.mlp_norm(h))))


class CharGPT(nn.Module):
    """A nanoGPT-style byte-level language model with tied input and output embeddings.

    Args:
        vocab: number of token values (256 for bytes).
        context: longest sequence (positions).
        width: residual-stream width.
        depth: number of blocks.
        heads: attention heads per block.
        activation: MLP activation name (see ``dynamics.activations.ACTIVATIONS``).
        shift: MLP activation shift (``none``, ``expected``, ``adaptive`` or a number).
    """

    def __init__(
        self,
        vocab: int = 256,
        context: int = 64,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        activation: str = "gelu",
        shift: str | float = "none",
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            GPTBlock(width, heads, ShiftedActivation(activation, shift)) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # weight tying, as GPT-2 and nanoGPT do
        for name, parameter in self.named_parameters():
            if name.endswith("weight") and parameter.dim() == 2:
                nn.init.normal_(parameter, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))
