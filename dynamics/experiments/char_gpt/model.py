"""The character experiment's model: a nanoGPT-style byte-level transformer."""

from __future__ import annotations

import torch
from torch import nn

from dynamics.experiments.transformer import TransformerBlock, gpt_init


class CharGPT(nn.Module):
    """A nanoGPT-style byte-level language model with tied input and output embeddings.

    Example::

        gpt = CharGPT(context=64, width=64, depth=2, heads=4)
        gpt(torch.randint(256, (4, 64))).shape  # (4, 64, 256): next-byte logits

    Args:
        vocab: number of token values (256 for bytes).
        context: longest sequence (positions).
        width: residual-stream width.
        depth: number of blocks.
        heads: attention heads per block.
        activation: MLP activation name (see
            :data:`~dynamics.experiments.transformer.ACTIVATION_MODULES`).
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
        gpt_init(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))
