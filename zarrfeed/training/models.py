"""Small real models, one per task: big enough to learn the sample data in a few dozen steps
on two CPU cores, built from the same conv blocks so that gradient checkpointing is one
switch for all of them."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def block(dims: int, cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    """conv 3 → GroupNorm → SiLU, in 2-D or 3-D."""
    conv = nn.Conv3d if dims == 3 else nn.Conv2d
    return nn.Sequential(
        conv(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.GroupNorm(min(8, cout), cout),
        nn.SiLU(inplace=True),
    )


class Stage(nn.Sequential):
    """Blocks run in order; with ``checkpointing`` each block's activations are recomputed in
    the backward pass instead of kept (less memory, about one more forward of compute)."""

    def __init__(self, *blocks: nn.Module, checkpointing: bool = False) -> None:
        super().__init__(*blocks)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            if self.checkpointing and self.training and x.requires_grad:
                x = checkpoint(module, x, use_reentrant=False)
            else:
                x = module(x)
        return x


class CTClassifier(nn.Module):
    """3-D CNN over a windowed patch or volume → one logit per label (multi-label)."""

    def __init__(self, labels: int = 18, width: int = 16, checkpointing: bool = False) -> None:
        super().__init__()
        w = width
        self.features = Stage(
            block(3, 1, w, 2),
            block(3, w, 2 * w, 2),
            block(3, 2 * w, 4 * w, 2),
            block(3, 4 * w, 4 * w),
            checkpointing=checkpointing,
        )
        self.head = nn.Linear(4 * w, labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3, 4)))


class OccupancyAutoencoder(nn.Module):
    """TRELLIS-style sparse-structure autoencoder: an occupancy grid G³ → latent (G/4)³ → logits."""

    def __init__(self, width: int = 16, latent: int = 8, checkpointing: bool = False) -> None:
        super().__init__()
        w = width
        self.encoder = Stage(block(3, 1, w, 2), block(3, w, 2 * w, 2), checkpointing=checkpointing)
        self.to_latent = nn.Conv3d(2 * w, latent, 1)
        self.decoder = Stage(
            nn.Sequential(nn.ConvTranspose3d(latent, 2 * w, 4, 2, 1), nn.SiLU(inplace=True)),
            nn.Sequential(nn.ConvTranspose3d(2 * w, w, 4, 2, 1), nn.SiLU(inplace=True)),
            checkpointing=checkpointing,
        )
        self.out = nn.Conv3d(w, 1, 3, padding=1)

    def forward(self, occupancy: torch.Tensor) -> torch.Tensor:
        return self.out(self.decoder(self.to_latent(self.encoder(occupancy))))


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
