"""Patch grids as a few integer arrays: no per-patch Python objects.

One dict per patch (≈360 B each, copied into every DataLoader worker) is what a patch index
costs when kept as Python objects.  Here a patch is an integer: along each axis the origin is
``min(k · stride, n − patch)``, so the last patch sits flush with the end and every voxel is
covered, and index → origin is arithmetic; the patches kept are stored as compact arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import numpy as np


def _as_tuple(v: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return (int(v),) * ndim if isinstance(v, int | np.integer) else tuple(int(x) for x in v)


def axis_counts(shape: np.ndarray, patch: np.ndarray, stride: np.ndarray, cover: bool):
    """Number of patch positions along each axis (broadcasts over leading item axes)."""
    span = shape - patch
    if np.any(span < 0):
        raise ValueError(f"patch {patch.tolist()} larger than shape {shape.tolist()}")
    full = span // stride + 1
    return full + (span % stride > 0) if cover else full


@dataclass(frozen=True)
class PatchGrid:
    """Regular N-D patch positions over one array shape."""

    shape: tuple[int, ...]
    patch: tuple[int, ...]
    stride: tuple[int, ...]
    cover: bool = True

    @classmethod
    def make(cls, shape, patch, stride=None, cover: bool = True) -> PatchGrid:
        shape = tuple(int(s) for s in shape)
        patch = _as_tuple(patch, len(shape))
        stride = patch if stride is None else _as_tuple(stride, len(shape))
        if len(patch) != len(shape) or len(stride) != len(shape) or min(stride) < 1:
            raise ValueError(f"bad patch {patch} / stride {stride} for shape {shape}")
        axis_counts(np.array(shape), np.array(patch), np.array(stride), cover)
        return cls(shape, patch, stride, cover)

    @property
    def counts(self) -> tuple[int, ...]:
        c = axis_counts(
            np.array(self.shape), np.array(self.patch), np.array(self.stride), self.cover
        )
        return tuple(int(x) for x in c)

    def __len__(self) -> int:
        return int(np.prod(self.counts))

    def positions(self, axis: int) -> np.ndarray:
        k = np.arange(self.counts[axis])
        return np.minimum(k * self.stride[axis], self.shape[axis] - self.patch[axis])

    def origin(self, index: int) -> tuple[int, ...]:
        if not 0 <= index < len(self):
            raise IndexError(f"patch {index} out of range for {len(self)} patches")
        ks = np.unravel_index(index, self.counts)
        return tuple(
            int(min(k * s, n - p))
            for k, s, n, p in zip(ks, self.stride, self.shape, self.patch, strict=True)
        )

    def origins(self, indices: np.ndarray | None = None) -> np.ndarray:
        """(n, ndim) int64 origins of ``indices`` (all patches when None)."""
        idx = np.arange(len(self)) if indices is None else np.asarray(indices)
        ks = np.stack(np.unravel_index(idx, self.counts), axis=-1)
        return np.minimum(ks * np.array(self.stride), np.array(self.shape) - np.array(self.patch))

    def slices(self, index: int) -> tuple[slice, ...]:
        return tuple(slice(o, o + p) for o, p in zip(self.origin(index), self.patch, strict=True))


def patch_fractions(mask: np.ndarray, grid: PatchGrid) -> np.ndarray:
    """Foreground fraction of every patch of ``grid`` over ``mask`` (float32, one per patch).

    Every patch edge along an axis is a patch origin or origin + patch, so the counts are
    first summed between consecutive edges (``add.reduceat``, one pass that shrinks the
    first axis patch-fold), and each patch is then a box of a summed-area table over that
    small grid of segments: exact integer counts, 0.05 s for a 240×480×480 scan where a
    full-resolution table took 0.4 s.
    """
    if tuple(mask.shape) != grid.shape:
        raise ValueError(f"mask shape {mask.shape} != grid shape {grid.shape}")
    sums: np.ndarray = (np.asarray(mask) != 0).view(np.uint8)
    lo_at, hi_at = [], []
    for axis, n in enumerate(mask.shape):
        pos = grid.positions(axis)
        ends = pos + grid.patch[axis]
        edges = np.unique(np.concatenate([[0], pos, ends]))
        starts = edges[edges < n]
        # The full-size first pass adds uint8 in the narrowest type that holds a segment's
        # count (2-3x faster than casting every voxel to int64); the rest are small.
        longest = int(np.diff(np.append(starts, n)).max())
        dtype = np.min_scalar_type(longest) if axis == 0 else np.int64
        sums = np.add.reduceat(sums, starts, axis=axis, dtype=dtype).astype(np.int64, copy=False)
        lo_at.append(np.searchsorted(starts, pos))
        hi_at.append(np.searchsorted(starts, ends))  # an end at n: past the last segment
    sat = np.zeros(tuple(k + 1 for k in sums.shape), dtype=np.int64)
    inner = sat[tuple(slice(1, None) for _ in sums.shape)]
    inner[...] = sums
    for axis in range(sums.ndim):
        np.cumsum(inner, axis=axis, out=inner)
    ks = np.unravel_index(np.arange(len(grid)), grid.counts)
    lo = np.stack([lo_at[a][k] for a, k in enumerate(ks)], axis=1)
    hi = np.stack([hi_at[a][k] for a, k in enumerate(ks)], axis=1)
    total = np.zeros(len(grid), dtype=np.int64)
    for corner in product((0, 1), repeat=mask.ndim):
        point = np.where(np.array(corner, dtype=bool), hi, lo)
        sign = -1 if (mask.ndim - sum(corner)) % 2 else 1
        total += sign * sat[tuple(point.T)]
    return (total / np.prod(grid.patch)).astype(np.float32)
