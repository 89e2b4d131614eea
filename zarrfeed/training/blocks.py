"""The conv blocks every task's model is built from, so that gradient checkpointing is one
switch for all of them; the models themselves live in their family's package."""

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
