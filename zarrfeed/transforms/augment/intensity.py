"""Intensity operations on float32 image batches (N, C, *spatial), one parameter per sample.

Each takes per-sample parameters already on the batch's device and works on the whole
batch at once; samples whose operation is off get the identity exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zarrfeed.transforms.augment.params import normals


def _per_sample(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(N,) parameters shaped to broadcast over ``x`` (N, C, *spatial)."""
    return values.to(x.dtype).view(-1, *(1,) * (x.dim() - 1))


def scale_shift(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``x * scale + shift``, in place."""
    return x.mul_(_per_sample(scale, x)).add_(_per_sample(shift, x))


def gamma(x: torch.Tensor, on: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``((x - min) / (range + 1e-7)) ** exponent * range + min`` per sample where ``on``."""
    dims = tuple(range(1, x.dim()))
    lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    spread = hi - lo
    y = (x - lo).div_(spread + 1e-7).pow_(_per_sample(exponent, x)).mul_(spread).add_(lo)
    return torch.where(_per_sample(on, x).bool(), y, x)


def add_noise(x: torch.Tensor, std: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``x + std * n`` with ``n`` standard normal per voxel, hashed from each sample's key
    and the voxel's position (so the same on every device and in any batch), in place."""
    n = normals(keys, x[0].numel()).view(x.shape)
    return x.add_(n.mul_(_per_sample(std, x)))


def blur(x: torch.Tensor, kernels: torch.Tensor) -> torch.Tensor:
    """Separable convolution of each sample with its own 1-D kernel (N, 2r + 1) along
    every spatial axis, edges replicated."""
    n, c, *shape = x.shape
    d, r = len(shape), (kernels.shape[1] - 1) // 2
    conv = F.conv2d if d == 2 else F.conv3d
    weights = kernels.repeat_interleave(c, dim=0)  # (N * C, k)
    for axis in range(d):
        pad = [0] * (2 * d)
        pad[2 * (d - 1 - axis)] = pad[2 * (d - 1 - axis) + 1] = r
        padded = F.pad(x, pad, mode="replicate")
        del x  # the previous pass's result: freed before the next one is allocated
        w = weights.view(n * c, 1, *[kernels.shape[1] if a == axis else 1 for a in range(d)])
        x = conv(padded.view(1, n * c, *padded.shape[2:]), w, groups=n * c).view(n, c, *shape)
        del padded
    return x
