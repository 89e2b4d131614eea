"""A seeded augmentation pipeline over a batch dictionary, on the batch's device.

Spatial operations (flip, 90° rotation, affine, elastic) move every declared key the same
way; intensity operations (blur, scale and shift, gamma, noise) touch the image keys only.
Order: spatial, blur, intensity, gamma, noise. Parameters depend on (seed, epoch, index)
alone, so a batch augmented on an accelerator equals its samples augmented one at a time
on the host, within float tolerance.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from zarrfeed.transforms.augment import intensity, spatial
from zarrfeed.transforms.augment.params import (
    AFFINE,
    BLUR,
    ELASTIC,
    FLIP,
    GAMMA,
    INTENSITY,
    NOISE,
    ROT90,
    Affine,
    Blur,
    Elastic,
    Flip,
    Gamma,
    Intensity,
    Noise,
    Rot90,
    host_indices,
    stream_key,
)

Role = Literal["image", "target", "mask"]
ROLES = ("image", "target", "mask")
PADDINGS = ("zeros", "border", "reflection")
PARAMETER_BYTES = 512  # per sample: matrices, kernels, keys and their copies on the device


@dataclass(frozen=True)
class Pipeline:
    """Which batch keys play which role, and the operations (None: off).

    Roles: ``image`` (resampled linearly, then the intensity operations), ``target``
    (resampled linearly only: a regression target such as a sharp frame), ``mask``
    (masks and label maps: nearest voxel, zero outside, dtype kept). Image and target keys
    come back in their floating dtype (float32 for integer inputs); computation is float32.
    """

    keys: Mapping[str, Role] = field(default_factory=lambda: {"image": "image"})
    flip: Flip | None = None
    rot90: Rot90 | None = None
    affine: Affine | None = None
    elastic: Elastic | None = None
    intensity: Intensity | None = None
    gamma: Gamma | None = None
    noise: Noise | None = None
    blur: Blur | None = None
    padding: Literal["zeros", "border", "reflection"] = "border"

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("augment: no keys to augment")
        bad = {k: r for k, r in self.keys.items() if r not in ROLES}
        if bad:
            raise ValueError(f"augment: roles must be one of {ROLES}, got {bad}")
        if self.padding not in PADDINGS:
            raise ValueError(f"augment: padding must be one of {PADDINGS}, got {self.padding!r}")

    def _tensors(self, batch: Mapping[str, Any], n: int) -> dict[str, torch.Tensor]:
        missing = [k for k in self.keys if k not in batch]
        if missing:
            raise KeyError(
                f"augment: the batch has no {missing} (it has {sorted(batch)}); "
                f"declared keys: {dict(self.keys)}"
            )
        tensors = {k: batch[k] for k in self.keys}
        first = next(iter(tensors.values()))
        for k, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dim() not in (4, 5):
                what = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"augment: batch[{k!r}] must be a tensor (N, C, H, W) or (N, C, D, H, W), "
                    f"got {what}"
                )
            if t.shape[0] != n or t.shape[2:] != first.shape[2:] or t.device != first.device:
                raise ValueError(
                    f"augment: batch[{k!r}] is {tuple(t.shape)} on {t.device}; expected "
                    f"{n} samples of spatial shape {tuple(first.shape[2:])} on {first.device} "
                    "like the other keys and the indices"
                )
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
        return out

    def _spatial(
        self, tensors: dict[str, torch.Tensor], seed: int, epoch: int, idx: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The keys moved by the spatial operations (none when no sample is moved)."""
        shape = tuple(next(iter(tensors.values())).shape[2:])
        d, n = len(shape), len(idx)
        device = next(iter(tensors.values())).device
        m = torch.eye(d, dtype=torch.float64).repeat(n, 1, 1)
        shift = torch.zeros(n, d, dtype=torch.float64)
        moved = general = False
        if self.flip is not None:
            m, on = self.flip.matrices(stream_key(seed, epoch, FLIP), idx, d)
            moved |= on
        if self.rot90 is not None:
            r, on = self.rot90.matrices(stream_key(seed, epoch, ROT90), idx, shape)
            m, moved = m @ r, moved | on
        if self.affine is not None:
            a, t, on = self.affine.matrices(stream_key(seed, epoch, AFFINE), idx, d)
            if on:
                shift, m, general = (m @ t[:, :, None])[:, :, 0], m @ a, True
        coarse = None
        if self.elastic is not None:
            coarse, on = self.elastic.coarse(stream_key(seed, epoch, ELASTIC), idx, d)
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
        self, x: torch.Tensor, owned: bool, seed: int, epoch: int, idx: torch.Tensor, key: str
    ) -> torch.Tensor:
        """The intensity operations on an image (float32 result; ``x`` itself is changed
        only when ``owned``); targets pass through."""
        if self.keys[key] != "image":
            return x
        device = x.device
        if x.dtype != torch.float32:
            x, owned = x.to(torch.float32), True

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        if self.blur is not None:
            kernels, on = self.blur.kernels(stream_key(seed, epoch, BLUR), idx)
            if on:
                x, owned = intensity.blur(x, put(kernels)), True
        if self.intensity is not None:
            scale, shift, on = self.intensity.draw(stream_key(seed, epoch, INTENSITY), idx)
            if on:
                x = x if owned else x.clone()
                x, owned = intensity.scale_shift(x, put(scale), put(shift)), True
        if self.gamma is not None:
            chosen, exponent, on = self.gamma.draw(stream_key(seed, epoch, GAMMA), idx)
            if on:
                x, owned = intensity.gamma(x, put(chosen), put(exponent)), True
        if self.noise is not None:
            name = zlib.crc32(key.encode())
            std, keys, on = self.noise.draw(stream_key(seed, epoch, NOISE, name), idx)
            if on:
                x = x if owned else x.clone()
                x = intensity.add_noise(x, put(std), put(keys))
        return x

    def _on(self, name: str) -> bool:
        op = getattr(self, name)
        return op is not None and op.p > 0

    def scratch_bytes(
        self, shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, torch.dtype]
    ) -> int:
        """Peak bytes :meth:`apply` allocates on the batch's device beyond its inputs
        (intermediates and outputs), for batches of these shapes and dtypes per declared key,
        with every operation whose ``p`` > 0 firing: what a device memory budget must leave
        free. Counted by construction, step by step as :meth:`apply` allocates and frees."""
        first = tuple(shapes[next(iter(self.keys))])
        live, peak = 0, PARAMETER_BYTES * first[0]  # the per-sample parameters, a few each

        def alloc(nbytes: float) -> None:
            nonlocal live, peak
            live += int(nbytes)
            peak = max(peak, live + PARAMETER_BYTES * first[0])

        def free(nbytes: float) -> None:
            nonlocal live
            live -= int(nbytes)

        space = first[2:]
        d, voxels = len(space), first[0] * math.prod(space)
        numel = {k: math.prod(shapes[k]) for k in self.keys}
        size = {k: torch.empty(0, dtype=dtypes[k]).element_size() for k in self.keys}
        general = self._on("affine") or self._on("elastic")
        held: dict[str, int] = {}  # the spatial stage's outputs, alive until apply returns
        if general:
            alloc(voxels * d * 4)  # the grid
            if self._on("elastic"):
                alloc(voxels * d * 4)
                free(voxels * d * 4)
            for k, role in self.keys.items():
                wide = dtypes[k] in (torch.int32, torch.int64)
                work = torch.float64 if role == "mask" and wide else torch.float32
                wsize = 8 if work == torch.float64 else 4
                cast = numel[k] * wsize if dtypes[k] != work else 0
                grid64 = voxels * d * 8 if work == torch.float64 else 0  # its float64 copy
                alloc(cast)
                alloc(grid64)
                alloc(numel[k] * wsize)
                free(cast + grid64)
                held[k] = numel[k] * wsize
                if role == "mask" and dtypes[k] != work:
                    alloc(numel[k] * size[k])
                    free(numel[k] * wsize)
                    held[k] = numel[k] * size[k]
            free(voxels * d * 4)
        elif self._on("flip") or self._on("rot90"):
            alloc(voxels * 8)  # the gather index
            for k in self.keys:
                held[k] = numel[k] * size[k]
                alloc(held[k])
            free(voxels * 8)
        for k, role in self.keys.items():
            v4, floating = numel[k] * 4, dtypes[k].is_floating_point
            warped = general and k in held  # float32 from the grid
            if role == "target":  # only the final cast
                if warped and floating and dtypes[k] != torch.float32:
                    alloc(numel[k] * size[k])
                elif not warped and not floating:
                    alloc(v4)
            elif role == "image":
                owned, current = warped or (k in held and dtypes[k] == torch.float32), 0
                if dtypes[k] != torch.float32 and not warped:
                    alloc(v4)  # the float32 working copy
                    current, owned = v4, True
                if self._on("blur"):
                    for axis, n in enumerate(space):
                        padded = v4 / n * (n + 2 * self.blur.radius)
                        alloc(padded)
                        if axis > 0:
                            free(v4)
                        alloc(v4)
                        free(padded)
                    free(current)
                    current, owned = v4, True
                if self._on("intensity") and not owned:
                    alloc(v4)  # the clone changed in place
                    current, owned = v4, True
                if self._on("gamma"):
                    alloc(2 * v4)
                    free(v4 + current)
                    current, owned = v4, True
                if self._on("noise"):
                    if not owned:
                        alloc(v4)
                        current = v4
                    alloc(numel[k] * 16)  # the hashed counters and one shifted copy
                    free(numel[k] * 16)
                if floating and dtypes[k] != torch.float32:
                    alloc(numel[k] * size[k])
                free(current)
        return peak
