"""Spatial resampling of a batch: one sampling grid (or one exact gather) per batch.

Every spatial operation is a map from output voxels to source voxels, written in voxel
coordinates centred on the array: ``source = M @ centred + t`` (plus an elastic
displacement). Flips and 90° rotations make ``M`` a signed permutation; when no sample of
the batch needs more, the batch is cut by one exact gather (any dtype, no interpolation);
otherwise all operations are folded into one ``affine_grid`` + ``grid_sample`` per
sampling mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _reversed(m: torch.Tensor) -> torch.Tensor:
    """Matrices (N, d, d) or vectors (N, d) with the axis order reversed: ``grid_sample``
    orders coordinates x (last axis) first."""
    if m.dim() == 3:
        return m.flip(1).flip(2)
    return m.flip(1)


def sampling_grid(
    matrix: torch.Tensor,
    shift: torch.Tensor,
    shape: tuple[int, ...],
    device: torch.device,
    displacement: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (N, *shape, d) float32 ``grid_sample`` grid (``align_corners=False``) for
    host matrices (N, d, d) and shifts (N, d) in voxels, plus an optional coarse elastic
    displacement (N, d, g, …) in voxels, interpolated to ``shape`` on ``device``."""
    half = torch.tensor(shape, dtype=torch.float64) / 2  # normalised unit, in voxels
    theta = matrix * half[None, None, :] / half[None, :, None]
    theta = torch.cat([_reversed(theta), _reversed(shift / half)[:, :, None]], dim=2)
    theta = theta.to(torch.float32).to(device, non_blocking=True)
    n = len(matrix)
    grid = F.affine_grid(theta, [n, 1, *shape], align_corners=False)
    if displacement is not None:
        mode = "bilinear" if len(shape) == 2 else "trilinear"
        coarse = (displacement / half[None, :].reshape(1, -1, *(1,) * len(shape))).to(torch.float32)
        fine = F.interpolate(
            coarse.to(device, non_blocking=True), size=shape, mode=mode, align_corners=True
        )
        d = len(shape)
        for j in range(d):
            grid[..., d - 1 - j] += fine[:, j]
        del fine
    return grid


def warp(x: torch.Tensor, grid: torch.Tensor, nearest: bool, padding: str) -> torch.Tensor:
    """``x`` (N, C, *shape) resampled at ``grid``: linearly for images (float32 result),
    at the nearest voxel for masks and labels (same dtype, zero outside)."""
    if nearest:
        exact = torch.float64 if x.dtype in (torch.int32, torch.int64) else torch.float32
        out = F.grid_sample(x.to(exact), grid.to(exact), mode="nearest", padding_mode="zeros",
                            align_corners=False)  # fmt: skip
        return out.to(x.dtype)
    return F.grid_sample(x.to(torch.float32), grid, mode="bilinear", padding_mode=padding,
                         align_corners=False)  # fmt: skip


def permutation_index(matrix: torch.Tensor, shape: tuple[int, ...], device: torch.device):
    """(N, prod(shape)) int64 flat source index of each output voxel for host signed
    permutation matrices (N, d, d) (flips and 90° rotations: exact, no interpolation)."""
    d = len(shape)
    strides = torch.ones(d, dtype=torch.int64)
    for j in range(d - 2, -1, -1):
        strides[j] = strides[j + 1] * shape[j + 1]
    m = matrix.round().to(torch.int64)
    weights = (strides[None, :, None] * m).sum(1).to(device, non_blocking=True)  # (N, d)
    # 2 * index = sum_j stride_j (S_j - 1) + sum_k w_k (2 o_k - (S_k - 1))
    twice = int(sum(int(s) * (n - 1) for s, n in zip(strides, shape, strict=True)))
    index = torch.full((len(m), *shape), twice, dtype=torch.int64, device=device)
    for k, n in enumerate(shape):
        steps = 2 * torch.arange(n, dtype=torch.int64, device=device) - (n - 1)
        view = [len(m)] + [n if a == k else 1 for a in range(d)]
        index += (weights[:, k, None] * steps[None]).view(view)
    return index.view(len(m), -1).div_(2, rounding_mode="floor")


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` (N, C, *shape) rearranged by a flat per-sample ``index`` (N, prod(shape))."""
    n, c = x.shape[:2]
    flat = x.reshape(n, c, -1)
    return flat.gather(2, index[:, None, :].expand(n, c, index.shape[1])).view(x.shape)
