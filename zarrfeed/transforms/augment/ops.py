"""The augmentation operations as declarations: what each does, its probability ``p`` per
sample, and its ranges. Plain frozen dataclasses (no torch), checked when made, so a
training config can name them without loading torch; :mod:`.params` draws their
per-sample parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

Role = Literal["image", "target", "mask"]


def _range(value: tuple[float, float], what: str) -> tuple[float, float]:
    lo, hi = (float(v) for v in value)
    if not lo <= hi:
        raise ValueError(f"{what}: the range must be (low, high) with low <= high, got {value}")
    return lo, hi


def _probability(p: float, what: str) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{what}: p must be in [0, 1], got {p}")


def axes_within(axes: tuple[int, ...], ndim: int, what: str) -> None:
    """Refuse axes that are not distinct spatial axes of an ``ndim``-D batch."""
    if any(not 0 <= a < ndim for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"{what}: axes {axes} must be distinct spatial axes of a {ndim}-D batch")


@dataclass(frozen=True)
class Flip:
    """Mirror each listed spatial axis (0 is the first spatial one) with probability ``p``."""

    p: float = 0.5
    axes: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self) -> None:
        _probability(self.p, "flip")


@dataclass(frozen=True)
class Rot90:
    """Rotate by k × 90° (k uniform in 1..3) in the plane of two spatial axes of equal
    size, with probability ``p``; k = 1 turns as ``torch.rot90(x, 1, axes)``."""

    p: float = 0.5
    axes: tuple[int, int] = (1, 2)

    def __post_init__(self) -> None:
        _probability(self.p, "rot90")
        if len(self.axes) != 2 or self.axes[0] == self.axes[1]:
            raise ValueError(f"rot90: axes must be two different spatial axes, got {self.axes}")

    def check_plane(self, shape: tuple[int, ...]) -> None:
        """Refuse a spatial ``shape`` it cannot turn: one that lacks its axes, or whose plane
        in them is not square (a quarter turn would swap the sizes)."""
        axes_within(self.axes, len(shape), "rot90")
        a, b = self.axes
        if shape[a] != shape[b]:
            raise ValueError(
                f"rot90 in spatial axes {self.axes} needs a square plane, "
                f"got sizes {shape[a]} and {shape[b]} (spatial shape {shape})"
            )


@dataclass(frozen=True)
class Affine:
    """With probability ``p``: rotation up to ± ``rotate`` degrees in each plane of two
    spatial axes, an isotropic zoom in ``scale`` (> 1 magnifies), shear up to ± ``shear``
    per axis pair, translation up to ± ``translate`` voxels per axis; all in voxel units,
    so anisotropic patches rotate rigidly."""

    p: float = 0.2
    rotate: float = 15.0
    scale: tuple[float, float] = (0.85, 1.15)
    shear: float = 0.0
    translate: float = 0.0

    def __post_init__(self) -> None:
        _probability(self.p, "affine")
        lo, _ = _range(self.scale, "affine scale")
        if lo <= 0:
            raise ValueError(f"affine scale must be > 0, got {self.scale}")


@dataclass(frozen=True)
class Elastic:
    """With probability ``p``: a smooth random displacement, up to ± ``magnitude`` voxels
    per axis at ``grid`` control points per axis, interpolated linearly between them."""

    p: float = 0.0
    magnitude: float = 4.0
    grid: int = 5

    def __post_init__(self) -> None:
        _probability(self.p, "elastic")
        if self.grid < 2:
            raise ValueError(f"elastic grid must be >= 2 control points, got {self.grid}")


@dataclass(frozen=True)
class Intensity:
    """With probability ``p``: ``x * scale + shift``, both drawn per sample (image units)."""

    p: float = 0.5
    scale: tuple[float, float] = (0.9, 1.1)
    shift: tuple[float, float] = (-0.1, 0.1)

    def __post_init__(self) -> None:
        _probability(self.p, "intensity")
        _range(self.scale, "intensity scale")
        _range(self.shift, "intensity shift")


@dataclass(frozen=True)
class Gamma:
    """With probability ``p``: ``((x - min) / (range + 1e-7)) ** gamma * range + min`` per
    sample (MONAI's ``AdjustContrast``), ``gamma`` drawn from ``range``."""

    p: float = 0.3
    range: tuple[float, float] = (0.7, 1.5)

    def __post_init__(self) -> None:
        _probability(self.p, "gamma")
        lo, _ = _range(self.range, "gamma range")
        if lo <= 0:
            raise ValueError(f"gamma must be > 0, got {self.range}")


@dataclass(frozen=True)
class Noise:
    """With probability ``p``: additive Gaussian noise, its std drawn from ``std``."""

    p: float = 0.3
    std: tuple[float, float] = (0.0, 0.05)

    def __post_init__(self) -> None:
        _probability(self.p, "noise")
        _range(self.std, "noise std")


@dataclass(frozen=True)
class Blur:
    """With probability ``p``: a Gaussian blur, sigma in voxels drawn from ``sigma``,
    truncated at 3 × the largest sigma (separable, one pass per axis)."""

    p: float = 0.2
    sigma: tuple[float, float] = (0.5, 1.0)

    def __post_init__(self) -> None:
        _probability(self.p, "blur")
        lo, _ = _range(self.sigma, "blur sigma")
        if lo < 0:
            raise ValueError(f"blur sigma must be >= 0, got {self.sigma}")

    @property
    def radius(self) -> int:
        return max(1, math.ceil(3 * self.sigma[1]))


@dataclass(frozen=True)
class Operations:
    """Every operation of one augmentation, each None when off: the one list of them."""

    flip: Flip | None = None
    rot90: Rot90 | None = None
    affine: Affine | None = None
    elastic: Elastic | None = None
    intensity: Intensity | None = None
    gamma: Gamma | None = None
    noise: Noise | None = None
    blur: Blur | None = None


OPERATIONS = tuple(f.name for f in fields(Operations))  # the operations' names
