"""Sparse occupancy: compact uint16 (N, 3) voxel coordinates and deterministic point sampling.

``np.argwhere`` on a 512³ volume dominates a loader that calls it per sample;
``np.flatnonzero`` + ``np.unravel_index`` returns the same rows (C order) several times faster
(``benchmarks/transforms.py``) and lets us pick the narrowest dtype up front.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from zarrfeed.transforms.ct import apply_window

COORD_DTYPE = np.uint16


class TooFewPointsError(ValueError):
    """An occupancy holds fewer points than the consumer's ``min_points``."""


def coords_from_mask(mask: np.ndarray) -> np.ndarray:
    """Coordinates of the non-zero voxels, C order, as compact uint16 (N, ndim)."""
    if max(mask.shape, default=0) > np.iinfo(COORD_DTYPE).max + 1:
        raise ValueError(f"shape {mask.shape} does not fit uint16 coordinates")
    flat = np.flatnonzero(mask)
    out = np.empty((flat.size, mask.ndim), dtype=COORD_DTYPE)
    for axis, idx in enumerate(np.unravel_index(flat, mask.shape)):
        out[:, axis] = idx
    return out


def downsample_occupancy(mask: np.ndarray, grid: int | tuple[int, ...]) -> np.ndarray:
    """Occupancy on a coarser grid (e.g. TRELLIS 64³): a cell is on if any voxel in it is.

    Voxel ``i`` of an axis of length ``n`` belongs to cell ``floor(i·g/n)``, so the shape
    need not be a multiple of the grid.  One pass per axis, the first of which shrinks the
    data g/n-fold (:func:`reduce_cells`), where float adaptive pooling took 1 s.
    """
    return reduce_cells(np.asarray(mask, dtype=bool), grid, np.logical_or, False)


def reduce_cells(
    x: np.ndarray, grid: int | tuple[int, ...], ufunc: np.ufunc, empty: object
) -> np.ndarray:
    """``ufunc`` (``logical_or``, ``maximum``…) over the voxels of each cell of ``grid``;
    cells no voxel falls in (an axis shorter than the grid) hold ``empty``."""
    grid = (grid,) * x.ndim if isinstance(grid, int) else tuple(grid)
    if len(grid) != x.ndim:
        raise ValueError(f"grid {grid} does not match shape {x.shape}")
    out = x
    for axis, (n, g) in enumerate(zip(x.shape, grid, strict=True)):
        if n >= g:  # every cell has at least one voxel: contiguous, increasing bounds
            # One reduce per cell, not ufunc.reduceat: reduceat along a leading axis took
            # 0.21 s for a 240×480×480 int16 volume where these slices take 0.01 s.
            bounds = -(-np.arange(g + 1) * n // g)
            index: list[slice] = [slice(None)] * out.ndim
            cells = []
            for lo, hi in pairwise(bounds):
                index[axis] = slice(lo, hi)
                cells.append(ufunc.reduce(out[tuple(index)], axis=axis))
            out = np.stack(cells, axis=axis)
        else:  # upsampling: each voxel lands in one cell, the cells between stay empty
            up = np.full((*out.shape[:axis], g, *out.shape[axis + 1 :]), empty, dtype=out.dtype)
            index = [slice(None)] * out.ndim
            index[axis] = np.arange(n) * g // n
            up[tuple(index)] = out
            out = up
    return out


def occupancy_coords(
    volume: np.ndarray,
    threshold: float,
    grid: int | tuple[int, ...] | None = None,
) -> np.ndarray:
    """uint16 coordinates of voxels ``> threshold``, optionally on a downsampled grid."""
    mask = volume > threshold
    if grid is not None:
        mask = downsample_occupancy(mask, grid)
    return coords_from_mask(mask)


def window_occupancy(
    hu: np.ndarray,
    windows: list[str],
    threshold: float,
    grid: int | tuple[int, ...] | None = None,
) -> dict[str, np.ndarray]:
    """``occupancy_coords(apply_window(hu, w), threshold, grid)`` for every window ``w``,
    bit for bit, from one pass over the HU volume.

    A window is a non-decreasing function of HU, so a cell holds a voxel above the threshold
    exactly when the window of the cell's highest HU is above it.  One block-max reduction of
    the int16 volume therefore serves every window, and the window is applied to the small
    grid of maxima with the same function that made the stored float16 windows: ~0.03 s for
    three windows of a 240×480×480 scan, where thresholding each float16 window took 0.27 s.
    """
    if grid is None:
        return {w: occupancy_coords(apply_window(hu, w), threshold) for w in windows}
    cells = (grid,) * hu.ndim if isinstance(grid, int) else tuple(grid)
    top = reduce_cells(hu, cells, np.maximum, hu.min() if hu.size else 0)
    # Cells no voxel falls in (an axis shorter than the grid) stay off whatever they hold.
    filled = np.ones(cells, dtype=bool)
    for axis, (n, g) in enumerate(zip(hu.shape, cells, strict=True)):
        if n < g:
            has = np.zeros(g, dtype=bool)
            has[np.arange(n) * g // n] = True
            filled &= has.reshape([g if a == axis else 1 for a in range(hu.ndim)])
    return {w: coords_from_mask((apply_window(top, w) > threshold) & filled) for w in windows}


def sample_rows(n: int, min_points: int, max_points: int, seed: int = 0) -> np.ndarray:
    """Which of ``n`` rows :func:`sample_points` keeps: all of them up to ``max_points``,
    else ``max_points`` chosen without replacement by ``seed``, in their order."""
    if not 0 < min_points <= max_points:
        raise ValueError(f"need 0 < min_points <= max_points, got {min_points}, {max_points}")
    if n < min_points:
        raise TooFewPointsError(f"{n} points, fewer than min_points={min_points}")
    if n <= max_points:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=max_points, replace=False))


def sample_points(
    coords: np.ndarray,
    min_points: int,
    max_points: int,
    seed: int = 0,
) -> np.ndarray:
    """At most ``max_points`` rows, chosen without replacement and kept in their order.

    The same ``seed`` always gives the same rows.  Fewer than ``min_points`` rows raise
    :class:`TooFewPointsError` so the caller can skip or report the sample.
    """
    rows = sample_rows(len(coords), min_points, max_points, seed)
    return coords if len(rows) == len(coords) else coords[rows]
