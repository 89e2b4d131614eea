"""Batched, seeded augmentation of (N, C, *spatial) batches on any device: pure torch.

:mod:`.params` (the operations and their counter-based per-sample parameters),
:mod:`.spatial` (one grid or one gather per batch), :mod:`.intensity` (image-only
operations), :mod:`.pipeline` (the pipeline over a batch dict, and its scratch memory).
Not imported by :mod:`zarrfeed.transforms` itself, so the array transforms load without it.
"""

from zarrfeed.transforms.augment.params import (
    Affine,
    Blur,
    Elastic,
    Flip,
    Gamma,
    Intensity,
    Noise,
    Rot90,
)
from zarrfeed.transforms.augment.pipeline import Pipeline

__all__ = [
    "Affine",
    "Blur",
    "Elastic",
    "Flip",
    "Gamma",
    "Intensity",
    "Noise",
    "Pipeline",
    "Rot90",
]
