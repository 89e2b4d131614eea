"""The CT family's models: small real networks, big enough to learn the sample data in a few
dozen steps on two CPU cores."""

from __future__ import annotations

import torch
from torch import nn

from zarrfeed.training.blocks import Stage, block


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
