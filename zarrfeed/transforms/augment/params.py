"""The operations' per-sample parameters, drawn from counters.

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

from typing import Any, TypeVar

import numpy as np
import torch

from zarrfeed.transforms.augment.ops import (
    Affine,
    Blur,
    Elastic,
    Flip,
    Gamma,
    Intensity,
    Noise,
    Rot90,
    axes_within,
)

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


def _between(u: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    lo, hi = bounds
    return lo + u * (hi - lo)


def _symmetric(u: torch.Tensor, half: float) -> torch.Tensor:
    return (2 * u - 1) * half


def flip_matrices(
    op: Flip, key: int, indices: torch.Tensor, ndim: int
) -> tuple[torch.Tensor, bool]:
    """(N, ndim, ndim) diagonal ±1 matrices, and whether any sample flips."""
    axes_within(op.axes, ndim, "flip")
    flips = uniforms(key, indices, len(op.axes)) < op.p
    diag = torch.ones(len(indices), ndim, dtype=torch.float64)
    for j, axis in enumerate(op.axes):
        diag[flips[:, j], axis] = -1.0
    return torch.diag_embed(diag), bool(flips.any())


def rot90_matrices(
    op: Rot90, key: int, indices: torch.Tensor, shape: tuple[int, ...]
) -> tuple[torch.Tensor, bool]:
    """(N, d, d) quarter-turn matrices for a batch of spatial ``shape``, and whether any
    sample turns."""
    ndim = len(shape)
    op.check_plane(shape)
    a, b = op.axes
    u = uniforms(key, indices, 2)
    turns = torch.where(u[:, 0] < op.p, 1 + (u[:, 1] * 3).long(), 0)
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)[turns]
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=torch.float64)[turns]
    m = torch.eye(ndim, dtype=torch.float64).repeat(len(indices), 1, 1)
    m[:, a, a], m[:, a, b], m[:, b, a], m[:, b, b] = cos, sin, -sin, cos
    return m, bool((turns > 0).any())


def affine_matrices(
    op: Affine, key: int, indices: torch.Tensor, ndim: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(N, ndim, ndim) source-from-output matrices, (N, ndim) translations in voxels, and
    whether any sample is transformed."""
    planes = [(a, b) for a in range(ndim) for b in range(a + 1, ndim)]
    n = len(indices)
    u = uniforms(key, indices, 2 + 2 * len(planes) + ndim)
    on = u[:, 0] < op.p
    gate = on.to(torch.float64)
    m = torch.eye(ndim, dtype=torch.float64).repeat(n, 1, 1)
    for j, (a, b) in enumerate(planes):
        angle = torch.deg2rad(_symmetric(u[:, 1 + j], op.rotate)) * gate
        r = torch.eye(ndim, dtype=torch.float64).repeat(n, 1, 1)
        c, s = torch.cos(angle), torch.sin(angle)
        r[:, a, a], r[:, a, b], r[:, b, a], r[:, b, b] = c, -s, s, c
        m = m @ r
    shear = torch.eye(ndim, dtype=torch.float64).repeat(n, 1, 1)
    for j, (a, b) in enumerate(planes):
        shear[:, a, b] = _symmetric(u[:, 1 + len(planes) + j], op.shear) * gate
    zoom = torch.where(on, _between(u[:, 1 + 2 * len(planes)], op.scale), 1.0)
    m = m @ shear / zoom[:, None, None]
    shift = _symmetric(u[:, 2 + 2 * len(planes) :], op.translate) * gate[:, None]
    return m, shift, bool(on.any())


def elastic_field(
    op: Elastic, key: int, indices: torch.Tensor, ndim: int
) -> tuple[torch.Tensor, bool]:
    """(N, ndim, grid, …) control-point displacements in voxels, and whether any sample
    moves."""
    u = uniforms(key, indices, 1 + ndim * op.grid**ndim)
    on = u[:, 0] < op.p
    field = _symmetric(u[:, 1:], op.magnitude) * on[:, None].to(torch.float64)
    return field.view(len(indices), ndim, *(op.grid,) * ndim), bool(on.any())


def intensity_draw(
    op: Intensity, key: int, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(scale, shift) per sample (1, 0 where off), and whether any sample changes."""
    u = uniforms(key, indices, 3)
    on = u[:, 0] < op.p
    scale = torch.where(on, _between(u[:, 1], op.scale), 1.0)
    shift = torch.where(on, _between(u[:, 2], op.shift), 0.0)
    return scale, shift, bool(on.any())


def gamma_draw(
    op: Gamma, key: int, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(on, exponent) per sample, and whether any sample changes."""
    u = uniforms(key, indices, 2)
    on = u[:, 0] < op.p
    return on, torch.where(on, _between(u[:, 1], op.range), 1.0), bool(on.any())


def noise_draw(
    op: Noise, key: int, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(std per sample, the sample's voxel key, whether any sample gets noise)."""
    u = uniforms(key, indices, 2)
    on = u[:, 0] < op.p
    std = torch.where(on, _between(u[:, 1], op.std), 0.0)
    return std, sample_keys(key ^ GOLDEN, indices), bool(on.any())


def blur_kernels(op: Blur, key: int, indices: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(N, 2 radius + 1) normalised float32 kernels (a unit impulse where off), and whether
    any sample is blurred."""
    u = uniforms(key, indices, 2)
    on = u[:, 0] < op.p
    sigma = torch.where(on, _between(u[:, 1], op.sigma), 0.0)[:, None]
    x = torch.arange(-op.radius, op.radius + 1, dtype=torch.float64)[None]
    k = torch.exp(-(x**2) / (2 * sigma.clamp_min(1e-12) ** 2))
    k = torch.where(sigma > 0, k, (x == 0).to(torch.float64))
    return (k / k.sum(1, keepdim=True)).to(torch.float32), bool(on.any())


def host_indices(indices: Any) -> torch.Tensor:
    """The batch's sample indices as a host int64 tensor (a device tensor is copied)."""
    if isinstance(indices, torch.Tensor):
        return indices.detach().to("cpu", torch.int64).reshape(-1)
    return torch.from_numpy(np.asarray(indices, dtype=np.int64).reshape(-1))
