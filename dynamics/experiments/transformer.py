"""The pre-LN transformer block both scale-up models stack
(:class:`~dynamics.experiments.char_gpt.model.CharGPT`,
:class:`~dynamics.experiments.vit_digits.model.ViT`), and GPT-2's initialization.

The MLP activations are plain activation modules (``nn.GELU``…), named by
:data:`MLP_ACTIVATIONS`, so that :func:`dynamics.bias.shift_activations` can shift them in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: The activation modules the transformers build, by the names of ``dynamics.bias.activations``.
ACTIVATION_MODULES: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
}

#: Name pattern of every MLP activation of :class:`CharGPT` and :class:`ViT` (one per block).
MLP_ACTIVATIONS = "blocks.*.act"


def activation_module(name: str) -> nn.Module:
    """A new activation module of the named kind (see :data:`ACTIVATION_MODULES`)."""
    if name not in ACTIVATION_MODULES:
        known = ", ".join(ACTIVATION_MODULES)
        raise ValueError(f"unknown activation {name!r}; choose from {known}")
    return ACTIVATION_MODULES[name]()


class SelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``.

    Args:
        width: model width.
        heads: attention heads (must divide ``width``).
        causal: each token attends to itself and earlier tokens only.
    """

    def __init__(self, width: int, heads: int, causal: bool) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = (
            t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, width))


class TransformerBlock(nn.Module):
    """Pre-LN transformer block: h ← h + attn(LN(h)); h ← h + W_down φ(W_up LN(h))."""

    def __init__(self, width: int, heads: int, activation: str, causal: bool) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, causal)
        self.mlp_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = activation_module(activation)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h))
        return h + self.down(self.act(self.up(self.mlp_norm(h))))


def gpt_init(model: nn.Module) -> None:
    """GPT-2's init: matrices and embeddings N(0, 0.02²), biases zero, LayerNorms (1, 0)."""
    for name, parameter in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(parameter)
        elif parameter.dim() >= 2:
            nn.init.normal_(parameter, std=0.02)
