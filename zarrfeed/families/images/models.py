"""The image family's model: small enough to find the sample defects in a hundred steps on two
CPU cores."""

from __future__ import annotations

import torch
from torch import nn

from zarrfeed.training.blocks import Stage, block


class DefectSegmenter(nn.Module):
    """A two-level U-Net: image patch → defect-mask logits.

    Channel 0 is the inspected image and the others its references; a defect is what the
    inspected image has and the references lack, so the differences to each reference are
    given to the network as extra channels rather than left for it to discover (with them it
    finds defects in a hundred steps; without, it first learns to predict none).
    """

    def __init__(self, channels: int = 3, width: int = 16, checkpointing: bool = False) -> None:
        super().__init__()
        w = width
        inputs = 2 * channels - 1  # the image and its channel-0 differences
        self.enc = Stage(block(2, inputs, w), block(2, w, w), checkpointing=checkpointing)
        self.down = Stage(
            block(2, w, 2 * w, 2), block(2, 2 * w, 2 * w), checkpointing=checkpointing
        )
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec = Stage(block(2, 3 * w, w), checkpointing=checkpointing)
        self.out = nn.Conv2d(w, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc(torch.cat([x, x[:, :1] - x[:, 1:]], dim=1))
        return self.out(self.dec(torch.cat([skip, self.up(self.down(skip))], dim=1)))
