"""The operations' declarations and their per-sample parameters, drawn from counters.

Every random number is a hash of (seed, epoch, sample index, operation, counter): no
generator state, no dependence on which samples share a batch or on the device. A run
repeats, a resumed epoch continues exactly, and one sample augmented alone gets the
parameters it gets in any batch. The hash works on 32-bit values held in int64 with
multipliers below 2**31, so no product overflows on any backend and Python ints and
tensors give the same bits.

Parameters are drawn on the host (a few numbers per sample) and copied to the batch's
device once; only the per-voxel noise is hashed on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
FLIP, ROT90, AFFINE, ELASTIC, INTENSITY, GAMMA, NOISE, BLUR = range(1, 9)  # stream ids

H = TypeVar("H", int, torch.Tensor)


def mix32(h: H) -> H:
    """A 32-bit avalanche finaliser (lowbias32's shape): ints return new ints; tensors
    (int64, values in [0, 2**32)) are mixed in place and returned."""
    h ^= h >> 16
    h *= 0x7FEB352D
    h &= M32
    h ^= h >> 15
    h *= 0x5BD1E995
    h &= M32
    h ^= h >> 16
    return h


def stream_key(*parts: int) -> int:
    """One 32-bit key for a tuple of integers (any size; folded 32 bits at a time)."""
    h = GOLDEN
    for part in parts:
        part &= (1 << 64) - 1
        h = mix32(h ^ (part & M32))
        h = mix32(h ^ (part >> 32))
    return h


def sample_keys(key: int, indices: torch.Tensor) -> torch.Tensor:
    """Per-sample keys (int64, host) of a stream: the stream key mixed with each index."""
    idx = indices.to(torch.int64)
    h = mix32(idx & M32 ^ key)
    return mix32(h ^ (idx >> 32) & M32)


def uniforms(key: int, indices: torch.Tensor, count: int) -> torch.Tensor:
    """(N, count) float64 uniforms in [0, 1): counter ``j`` of each sample's stream."""
    counters = mix32((torch.arange(count, dtype=torch.int64) + 1) * GOLDEN & M32)
    h = mix32(sample_keys(key, indices)[:, None] ^ counters[None])
    return mix32(h).to(torch.float64) * 2.0**-32


def normals(keys: torch.Tensor, count: int) -> torch.Tensor:
    """(N, count) float32 standard normals, ``count`` per sample key, on the keys' device
    (the inverse normal CDF of a 24-bit uniform; tails to about 5.3 sigma). The counters
    are mixed once for all samples, then with each sample's key: one hash per voxel."""
    counters = mix32(torch.arange(count, dtype=torch.int64, device=keys.device))  # shared
    h = mix32(counters[None] ^ keys[:, None])
    del counters
    h >>= 8
    u = h.to(torch.float32).add_(0.5).mul_(2.0**-24)
    del h
    return torch.special.ndtri(u, out=u)


def _range(value: tuple[float, float], what: str) -> tuple[float, float]:
    lo, hi = (float(v) for v in value)
    if not lo <= hi:
        raise ValueError(f"{what}: the range must be (low, high) with low <= high, got {value}")
    return lo, hi


def _probability(p: float, what: str) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{what}: p must be in [0, 1], got {p}")


def _between(u: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    lo, hi = bounds
    return lo + u * (hi - lo)


def _symmetric(u: torch.Tensor, half: float) -> torch.Tensor:
    return (2 * u - 1) * half


@dataclass(frozen=True)
class Flip:
    """Mirror each listed spatial axis (0 is the first after N, C) with probability ``p``."""

    p: float = 0.5
    axes: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self) -> None:
        _probability(self.p, "flip")

    def matrices(self, key: int, indices: torch.Tensor, ndim: int) -> tuple[torch.Tensor, bool]:
        """(N, ndim, ndim) diagonal ±1 matrices, and whether any sample flips."""
        _axes_within(self.axes, ndim, "flip")
        n = len(indices)
        flips = uniforms(key, indices, len(self.axes)) < self.p
        diag = torch.ones(n, ndim, dtype=torch.float64)
        for j, axis in enumerate(self.axes):
            diag[flips[:, j], axis] = -1.0
        return torch.diag_embed(diag), bool(flips.any())


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

    def matrices(
        self, key: int, indices: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, bool]:
        ndim = len(shape)
        _axes_within(self.axes, ndim, "rot90")
        a, b = self.axes
        if shape[a] != shape[b]:
            raise ValueError(
                f"rot90 in spatial axes {self.axes} needs a square plane, "
                f"got sizes {shape[a]} and {shape[b]} (spatial shape {shape})"
            )
        u = uniforms(key, indices, 2)
        turns = torch.where(u[:, 0] < self.p, 1 + (u[:, 1] * 3).long(), 0)
        cos = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)[turns]
        sin = torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=torch.float64)[turns]
        m = torch.eye(ndim, dtype=torch.float64).repeat(len(indices), 1, 1)
        m[:, a, a], m[:, a, b], m[:, b, a], m[:, b, b] = cos, sin, -sin, cos
        return m, bool((turns > 0).any())


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

    def matrices(
        self, key: int, indices: torch.Tensor, ndim: int
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(N, ndim, ndim) source-from-output matrices, (N, ndim) translations in voxels,
        and whether any sample is transformed."""
        planes = [(a, b) for a in range(ndim) for b in range(a + 1, ndim)]
        n = len(indices)
        u = uniforms(key, indices, 2 + 2 * len(planes) + ndim)
        on = u[:, 0] < self.p
        gate = on.to(torch.float64)
        m = torch.eye(ndim, dtype=torch.float64).repeat(n, 1, 1)
        for j, (a, b) in enumerate(planes):
            angle = torch.deg2rad(_symmetric(u[:, 1 + j], self.rotate)) * gate
            r = torch.eye(ndim, dtype=torch.float64).repeat(n, 1, 1)
            c, s = torch.cos(angle), torch.sin(angle)
            r[:, a, a], r[:, a, b], r[:, b, a], r[:, b, b] = c, -s, s, c
            m = m @ r
        shear = torch.eye(ndim, dtype=torch.float64).repeat(n, 1, 1)
        for j, (a, b) in enumerate(planes):
            shear[:, a, b] = _symmetric(u[:, 1 + len(planes) + j], self.shear) * gate
        zoom = torch.where(on, _between(u[:, 1 + 2 * len(planes)], self.scale), 1.0)
        m = m @ shear / zoom[:, None, None]
        shift = _symmetric(u[:, 2 + 2 * len(planes) :], self.translate) * gate[:, None]
        return m, shift, bool(on.any())


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

    def coarse(self, key: int, indices: torch.Tensor, ndim: int) -> tuple[torch.Tensor, bool]:
        """(N, ndim, grid, …) displacements in voxels, and whether any sample moves."""
        count = ndim * self.grid**ndim
        u = uniforms(key, indices, 1 + count)
        on = u[:, 0] < self.p
        field = _symmetric(u[:, 1:], self.magnitude) * on[:, None].to(torch.float64)
        return field.view(len(indices), ndim, *(self.grid,) * ndim), bool(on.any())


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

    def draw(self, key: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        u = uniforms(key, indices, 3)
        on = u[:, 0] < self.p
        scale = torch.where(on, _between(u[:, 1], self.scale), 1.0)
        shift = torch.where(on, _between(u[:, 2], self.shift), 0.0)
        return scale, shift, bool(on.any())


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

    def draw(self, key: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        u = uniforms(key, indices, 2)
        on = u[:, 0] < self.p
        return on, torch.where(on, _between(u[:, 1], self.range), 1.0), bool(on.any())


@dataclass(frozen=True)
class Noise:
    """With probability ``p``: additive Gaussian noise, its std drawn from ``std``."""

    p: float = 0.3
    std: tuple[float, float] = (0.0, 0.05)

    def __post_init__(self) -> None:
        _probability(self.p, "noise")
        _range(self.std, "noise std")

    def draw(self, key: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(std per sample, the sample's voxel key, whether any sample gets noise)."""
        u = uniforms(key, indices, 2)
        on = u[:, 0] < self.p
        std = torch.where(on, _between(u[:, 1], self.std), 0.0)
        return std, sample_keys(key ^ GOLDEN, indices), bool(on.any())


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

    def kernels(self, key: int, indices: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(N, 2 radius + 1) normalised float32 kernels (a unit impulse where off)."""
        u = uniforms(key, indices, 2)
        on = u[:, 0] < self.p
        sigma = torch.where(on, _between(u[:, 1], self.sigma), 0.0)[:, None]
        x = torch.arange(-self.radius, self.radius + 1, dtype=torch.float64)[None]
        k = torch.exp(-(x**2) / (2 * sigma.clamp_min(1e-12) ** 2))
        k = torch.where(sigma > 0, k, (x == 0).to(torch.float64))
        return (k / k.sum(1, keepdim=True)).to(torch.float32), bool(on.any())


def _axes_within(axes: tuple[int, ...], ndim: int, what: str) -> None:
    if any(not 0 <= a < ndim for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"{what}: axes {axes} must be distinct spatial axes of a {ndim}-D batch")


def host_indices(indices: Any) -> torch.Tensor:
    """The batch's sample indices as a host int64 tensor (a device tensor is copied)."""
    if isinstance(indices, torch.Tensor):
        return indices.detach().to("cpu", torch.int64).reshape(-1)
    return torch.from_numpy(np.asarray(indices, dtype=np.int64).reshape(-1))
