"""The spike family's model: small enough to learn the sample clips in a few dozen steps on two
CPU cores."""

from __future__ import annotations

import torch
from torch import nn

from zarrfeed.training.blocks import Stage, block


class SpikeDeblur(nn.Module):
    """Blurred frame + spike voxels of the clip → sharp frame, as a residual on the blur."""

    def __init__(self, in_channels: int, width: int = 16, checkpointing: bool = False) -> None:
        super().__init__()
        w = width
        self.body = Stage(
            block(2, in_channels, w), block(2, w, w), block(2, w, w), checkpointing=checkpointing
        )
        self.out = nn.Conv2d(w, 3, 3, padding=1)

    def forward(self, blur: torch.Tensor, voxels: torch.Tensor) -> torch.Tensor:
        return blur + self.out(self.body(torch.cat([blur, voxels], dim=1)))
