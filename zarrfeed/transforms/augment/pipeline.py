"""A seeded augmentation pipeline over a batch dictionary, on the batch's device.

Spatial operations (flip, 90° rotation, affine, elastic) move every declared key the same
way; intensity operations (blur, scale and shift, gamma, noise) touch the image keys only.
Order: spatial, blur, intensity, gamma, noise. Parameters depend on (seed, epoch, index)
alone, so a batch augmented on an accelerator equals its samples augmented one at a time
on the host, within float tolerance.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from zarrfeed.transforms.augment import intensity, params, scratch, spatial
from zarrfeed.transforms.augment.ops import Operations, Role
from zarrfeed.transforms.augment.params import (
    AFFINE,
    BLUR,
    ELASTIC,
    FLIP,
    GAMMA,
    INTENSITY,
    NOISE,
    ROT90,
    host_indices,
    stream_key,
)

ROLES = ("image", "target", "mask")
PADDINGS = ("zeros", "border", "reflection")


@dataclass(frozen=True)
class Pipeline(Operations):
    """Which batch keys play which role, and the operations (:class:`.ops.Operations`,
    None: off).

    Roles: ``image`` (resampled linearly, then the intensity operations), ``target``
    (resampled linearly only: a regression target such as a sharp frame, or an input no
    intensity operation fits), ``mask`` (masks and label maps: nearest voxel, zero
    outside, dtype kept). Image and target keys come back in their floating dtype (float32
    for integer inputs); computation is float32.

    ``spatial_dims``: how many trailing dimensions are spatial; the ones between N and
    them are channels (a clip (N, L, C, H, W) with 2). Default: every one after N, C.
    """

    keys: Mapping[str, Role] = field(default_factory=lambda: {"image": "image"})
    padding: Literal["zeros", "border", "reflection"] = "border"
    spatial_dims: Literal[2, 3] | None = None

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("augment: no keys to augment")
        bad = {k: r for k, r in self.keys.items() if r not in ROLES}
        if bad:
            raise ValueError(f"augment: roles must be one of {ROLES}, got {bad}")
        if self.padding not in PADDINGS:
            raise ValueError(f"augment: padding must be one of {PADDINGS}, got {self.padding!r}")
        if self.spatial_dims not in (None, 2, 3):
            raise ValueError(f"augment: spatial_dims must be 2, 3 or None, got {self.spatial_dims}")

    def _tensors(self, batch: Mapping[str, Any], n: int) -> dict[str, torch.Tensor]:
        missing = [k for k in self.keys if k not in batch]
        if missing:
            raise KeyError(
                f"augment: the batch has no {missing} (it has {sorted(batch)}); "
                f"declared keys: {dict(self.keys)}"
            )
        tensors: dict[str, torch.Tensor] = {}
        first = batch[next(iter(self.keys))]
        for k in self.keys:
            t = batch[k]
            d = self.spatial_dims
            if not isinstance(t, torch.Tensor) or not (
                t.dim() in (4, 5) if d is None else t.dim() >= d + 2
            ):
                what = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                want = "(N, C, H, W) or (N, C, D, H, W)" if d is None else f"(N, C, ..., {d} axes)"
                raise ValueError(f"augment: batch[{k!r}] must be a tensor {want}, got {what}")
            space = t.shape[2:] if d is None else t.shape[t.dim() - d :]
            want = first.shape[2:] if d is None else first.shape[first.dim() - d :]
            if t.shape[0] != n or space != want or t.device != first.device:
                raise ValueError(
                    f"augment: batch[{k!r}] is {tuple(t.shape)} on {t.device}; expected "
                    f"{n} samples of spatial shape {tuple(want)} on {first.device} "
                    "like the other keys and the indices"
                )
            tensors[k] = t.reshape(n, -1, *space)  # extra leading axes are channels
        return tensors

    def apply(
        self,
        batch: Mapping[str, Any],
        seed: int,
        epoch: int,
        indices: Sequence[int] | Any,
    ) -> dict[str, Any]:
        """A new batch dict with the declared keys augmented; ``indices`` are the dataset
        indices of the batch's samples, in order (host values: a device tensor is copied)."""
        idx = host_indices(indices)
        tensors = self._tensors(batch, len(idx))
        out = dict(batch)
        moved = self._spatial(tensors, seed, epoch, idx)
        for k, role in self.keys.items():
            t, src = moved.get(k, tensors[k]), tensors[k]
            if role == "mask":
                out[k] = t
                continue
            dtype = src.dtype if src.is_floating_point() else torch.float32
            x = self._intensity(t, k in moved, seed, epoch, idx, k)
            out[k] = x.to(dtype)
            del x  # before the next key's intermediates (scratch_bytes counts on it)
        for k in self.keys:
            out[k] = out[k].view(batch[k].shape)
        return out

    def apply_sample(
        self, sample: Mapping[str, Any], seed: int, epoch: int, index: int
    ) -> dict[str, Any]:
        """One sample (its declared keys without the batch axis: (C, *spatial)) augmented
        as it is in any batch: what a DataLoader worker applies on the host."""
        one = {k: v[None] if k in self.keys else v for k, v in sample.items()}
        out = self.apply(one, seed, epoch, [index])
        return {k: out[k][0] if k in self.keys else out[k] for k in out}

    def _spatial(
        self, tensors: dict[str, torch.Tensor], seed: int, epoch: int, idx: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The keys moved by the spatial operations (none when no sample is moved)."""

        def key(op: int) -> int:
            return stream_key(seed, epoch, op)

        shape = tuple(next(iter(tensors.values())).shape[2:])
        d, n = len(shape), len(idx)
        device = next(iter(tensors.values())).device
        m = torch.eye(d, dtype=torch.float64).repeat(n, 1, 1)
        shift = torch.zeros(n, d, dtype=torch.float64)
        moved = general = False
        if self.flip is not None:
            m, on = params.flip_matrices(self.flip, key(FLIP), idx, d)
            moved |= on
        if self.rot90 is not None:
            r, on = params.rot90_matrices(self.rot90, key(ROT90), idx, shape)
            m, moved = m @ r, moved | on
        if self.affine is not None:
            a, t, on = params.affine_matrices(self.affine, key(AFFINE), idx, d)
            if on:
                shift, m, general = (m @ t[:, :, None])[:, :, 0], m @ a, True
        coarse = None
        if self.elastic is not None:
            coarse, on = params.elastic_field(self.elastic, key(ELASTIC), idx, d)
            coarse, general = (coarse if on else None), general | on
        if general:
            grid = spatial.sampling_grid(m, shift, shape, device, coarse)
            return {
                k: spatial.warp(x, grid, self.keys[k] == "mask", self.padding)
                for k, x in tensors.items()
            }
        if moved:
            index = spatial.permutation_index(m, shape, device)
            return {k: spatial.gather(x, index) for k, x in tensors.items()}
        return {}

    def _intensity(
        self, x: torch.Tensor, owned: bool, seed: int, epoch: int, idx: torch.Tensor, name: str
    ) -> torch.Tensor:
        """The intensity operations on an image (float32 result; ``x`` itself is changed
        only when ``owned``); targets pass through."""
        if self.keys[name] != "image":
            return x
        device = x.device
        if x.dtype != torch.float32:
            x, owned = x.to(torch.float32), True

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        def key(op: int) -> int:
            return stream_key(seed, epoch, op)

        if self.blur is not None:
            kernels, on = params.blur_kernels(self.blur, key(BLUR), idx)
            if on:
                x, owned = intensity.blur(x, put(kernels)), True
        if self.intensity is not None:
            scale, shift, on = params.intensity_draw(self.intensity, key(INTENSITY), idx)
            if on:
                x = x if owned else x.clone()
                x, owned = intensity.scale_shift(x, put(scale), put(shift)), True
        if self.gamma is not None:
            chosen, exponent, on = params.gamma_draw(self.gamma, key(GAMMA), idx)
            if on:
                x, owned = intensity.gamma(x, put(chosen), put(exponent)), True
        if self.noise is not None:
            stream = stream_key(seed, epoch, NOISE, zlib.crc32(name.encode()))
            std, keys, on = params.noise_draw(self.noise, stream, idx)
            if on:
                x = x if owned else x.clone()
                x = intensity.add_noise(x, put(std), put(keys))
        return x

    def scratch_bytes(
        self, shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, torch.dtype]
    ) -> int:
        """Peak bytes :meth:`apply` allocates on the batch's device beyond its inputs
        (intermediates and outputs) for batches of these shapes and dtypes per declared
        key: what a device memory budget must leave free (see :mod:`.scratch`)."""
        return scratch.scratch_bytes(self, shapes, dtypes)
