"""The digits experiment's model: a small vision transformer reading the image's own patches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dynamics.experiments.transformer import TransformerBlock, gpt_init


class ViT(nn.Module):
    """A small vision transformer: non-overlapping square patches, a class token, pre-LN blocks.

    Example::

        vit = ViT(image_size=8, patch_size=2, channels=1, classes=10)
        vit(torch.rand(16, 1, 8, 8)).shape  # (16, 10)

    Args:
        image_size: side of the (square) input images.
        patch_size: side of a patch (must divide ``image_size``).
        channels: input channels.
        classes: output logits.
        width: residual-stream width.
        depth: number of blocks.
        heads: attention heads per block.
        activation: MLP activation name (see
            :data:`~dynamics.experiments.transformer.ACTIVATION_MODULES`).
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
        gpt_init(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # (N, C, H, W) -> (N, patches, C·p·p), patches in row-major order.
        patches = F.unfold(images, self.patch_size, stride=self.patch_size).transpose(1, 2)
        h = self.patches(patches)
        h = torch.cat([self.cls.expand(len(h), -1, -1), h], dim=1) + self.positions
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h[:, 0]))
