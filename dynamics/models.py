"""The models the experiments train: the paper's pre-norm residual MLP stack (attention and head
stripped), a nanoGPT-style character transformer and a small vision transformer.

The transformers' MLP activations are plain activation modules (``nn.GELU``…), named by
:data:`MLP_ACTIVATIONS`, so that :func:`dynamics.bias.shift_activations` can shift them in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


def _gpt_init(model: nn.Module) -> None:
    """GPT-2's init: matrices and embeddings N(0, 0.02²), biases zero, LayerNorms (1, 0)."""
    for name, parameter in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(parameter)
        elif parameter.dim() >= 2:
            nn.init.normal_(parameter, std=0.02)


class CharGPT(nn.Module):
    """A nanoGPT-style byte-level language model with tied input and output embeddings.

    Args:
        vocab: number of token values (256 for bytes).
        context: longest sequence (positions).
        width: residual-stream width.
        depth: number of blocks.
        heads: attention heads per block.
        activation: MLP activation name (see :data:`ACTIVATION_MODULES`).
    """

    def __init__(
        self,
        vocab: int = 256,
        context: int = 64,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        activation: str = "gelu",
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            TransformerBlock(width, heads, activation, causal=True) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # weight tying, as GPT-2 and nanoGPT do
        _gpt_init(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class ViT(nn.Module):
    """A small vision transformer: non-overlapping square patches, a class token, pre-LN blocks.

    Args:
        image_size: side of the (square) input images.
        patch_size: side of a patch (must divide ``image_size``).
        channels: input channels.
        classes: output logits.
        width: residual-stream width.
        depth: number of blocks.
        heads: attention heads per block.
        activation: MLP activation name (see :data:`ACTIVATION_MODULES`).
    """

    def __init__(
        self,
        image_size: int = 8,
        patch_size: int = 2,
        channels: int = 1,
        classes: int = 10,
        width: int = 64,
        depth: int = 4,
        heads: int = 4,
        activation: str = "gelu",
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"patch_size {patch_size} does not divide image_size {image_size}")
        self.patch_size = patch_size
        patches = (image_size // patch_size) ** 2
        self.patches = nn.Linear(channels * patch_size**2, width)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.positions = nn.Parameter(torch.zeros(1, patches + 1, width))
        self.blocks = nn.ModuleList(
            TransformerBlock(width, heads, activation, causal=False) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)
        _gpt_init(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # (N, C, H, W) -> (N, patches, C·p·p), patches in row-major order.
        patches = F.unfold(images, self.patch_size, stride=self.patch_size).transpose(1, 2)
        h = self.patches(patches)
        h = torch.cat([self.cls.expand(len(h), -1, -1), h], dim=1) + self.positions
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h[:, 0]))
