"""Where a training process runs: its place in a ``torchrun`` job, its device, its mixed
precision and the optimiser that suits that device."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from zarrfeed.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a ``torchrun`` job (rank 0 of 1 without one)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        return cls(
            int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))
        )

    @property
    def main(self) -> bool:
        return self.rank == 0


def resolve_device(spec: str, env: DistEnv) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return device


def amp_policy(mode: str, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None, use a GradScaler) for ``train.amp`` on ``device``.

    ``auto``: bf16 on CUDA devices that support it, else fp16 with a scaler; fp32 on the
    CPU, where bf16 autocast turned the 3-D CNNs' first-layer gradients into NaN after one
    step on real batches (ct_classifier, seed 5) and is no faster without native bf16 units.
    ``bf16`` still asks for it on the CPU.
    """
    if mode == "auto":
        mode = (
            "off" if device.type == "cpu" else "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        )
    if mode == "off":
        return None, False
    if mode == "fp16" and device.type != "cuda":
        raise ConfigError("train.amp=fp16 needs CUDA; use bf16 (or auto) on the CPU")
    return (torch.bfloat16, False) if mode == "bf16" else (torch.float16, True)


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.AdamW:
    """AdamW; fused on CUDA, where it is the fastest kernel and — the reason it matters with
    fp16 — takes the GradScaler's inf check and scale as device tensors, so a scaled step
    never waits for the device (any other optimizer makes ``GradScaler.step`` read the inf
    flag back to the host every step).  The CPU keeps torch's default implementation."""
    return torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=weight_decay, fused=device.type == "cuda" or None
    )
