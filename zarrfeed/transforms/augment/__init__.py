"""Batched, seeded augmentation of (N, C, *spatial) batches on any device: pure torch.

:mod:`.ops` (the operations' declarations, torch-free), :mod:`.params` (their
counter-based per-sample parameters), :mod:`.spatial` (one grid or one gather per batch),
:mod:`.intensity` (image-only operations), :mod:`.pipeline` (:class:`Pipeline`, over a
batch dict), :mod:`.scratch` (the device memory a call needs). Importing the package loads
the declarations only; :class:`Pipeline` loads torch on first use, so a training config
names the operations without it. Not imported by :mod:`zarrfeed.transforms` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zarrfeed.transforms.augment.ops import (
    OPERATIONS,
    Affine,
    Blur,
    Elastic,
    Flip,
    Gamma,
    Intensity,
    Noise,
    Operations,
    Role,
    Rot90,
)

if TYPE_CHECKING:
    from zarrfeed.transforms.augment.pipeline import Pipeline as Pipeline

__all__ = [
    "OPERATIONS",
    "Affine",
    "Blur",
    "Elastic",
    "Flip",
    "Gamma",
    "Intensity",
    "Noise",
    "Operations",
    "Pipeline",
    "Role",
    "Rot90",
]


def __getattr__(name: str) -> Any:
    if name == "Pipeline":
        from zarrfeed.transforms.augment.pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'zarrfeed.transforms.augment' has no attribute {name!r}")
