"""The device memory one :meth:`Pipeline.apply` needs beyond its inputs, by construction.

The count walks the stages as ``apply`` runs them, allocating and freeing what each one
does (grids, gather indices, float32 working copies, blur passes, hashed noise counters,
outputs), with every operation whose ``p`` > 0 firing, and takes the worst of the three
ways a batch can be moved: by a grid, by a gather, or not at all. A device slot pool
leaves this much free for each batch in flight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zarrfeed.transforms.augment.pipeline import Pipeline

PARAMETER_BYTES = 512  # per sample: matrices, kernels, keys and their copies on the device


class _Tally:
    def __init__(self, floor: int) -> None:
        self.live, self.peak, self.floor = 0, floor, floor

    def alloc(self, nbytes: float) -> None:
        self.live += int(nbytes)
        self.peak = max(self.peak, self.live + self.floor)

    def free(self, nbytes: float) -> None:
        self.live -= int(nbytes)


def _on(pipeline: Pipeline, name: str) -> bool:
    op = getattr(pipeline, name)
    return op is not None and op.p > 0


def scratch_bytes(
    pipeline: Pipeline, shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, torch.dtype]
) -> int:
    """Peak bytes ``pipeline.apply`` allocates for batches of these per-key shapes and
    dtypes (the declared keys), intermediates and outputs together."""
    modes = ["none"]
    if _on(pipeline, "affine") or _on(pipeline, "elastic"):
        modes.append("grid")
    if _on(pipeline, "flip") or _on(pipeline, "rot90"):
        modes.append("gather")
    return max(_peak(pipeline, shapes, dtypes, mode) for mode in modes)


def _peak(
    pipeline: Pipeline,
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, torch.dtype],
    mode: str,
) -> int:
    first = tuple(shapes[next(iter(pipeline.keys))])
    space = first[len(first) - pipeline.spatial_dims :] if pipeline.spatial_dims else first[2:]
    d, voxels = len(space), first[0] * math.prod(space)
    numel = {k: math.prod(shapes[k]) for k in pipeline.keys}
    size = {k: torch.empty(0, dtype=dtypes[k]).element_size() for k in pipeline.keys}
    tally = _Tally(PARAMETER_BYTES * first[0])
    alloc, free = tally.alloc, tally.free
    held: dict[str, int] = {}  # the spatial stage's outputs, alive until apply returns
    if mode == "grid":
        alloc(voxels * d * 4)  # the grid
        if _on(pipeline, "elastic"):
            alloc(voxels * d * 4)
            free(voxels * d * 4)
        for k, role in pipeline.keys.items():
            wide = dtypes[k] in (torch.int32, torch.int64)
            work = torch.float64 if role == "mask" and wide else torch.float32
            wsize = 8 if work == torch.float64 else 4
            cast = numel[k] * wsize if dtypes[k] != work else 0
            grid64 = voxels * d * 8 if work == torch.float64 else 0  # its float64 copy
            alloc(cast + grid64)
            alloc(numel[k] * wsize)
            free(cast + grid64)
            held[k] = numel[k] * wsize
            if role == "mask" and dtypes[k] != work:
                alloc(numel[k] * size[k])
                free(numel[k] * wsize)
                held[k] = numel[k] * size[k]
        free(voxels * d * 4)
    elif mode == "gather":
        alloc(voxels * 8)  # the gather index
        for k in pipeline.keys:
            held[k] = numel[k] * size[k]
            alloc(held[k])
        free(voxels * 8)
    for k, role in pipeline.keys.items():
        v4, floating = numel[k] * 4, dtypes[k].is_floating_point
        warped = mode == "grid"  # float32 from the grid
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
            if _on(pipeline, "blur"):
                for axis, n in enumerate(space):
                    padded = v4 / n * (n + 2 * pipeline.blur.radius)
                    alloc(padded)
                    if axis > 0:
                        free(v4)  # the previous pass
                    alloc(v4)
                    free(padded)
                free(current)
                current, owned = v4, True
            if _on(pipeline, "intensity") and not owned:
                alloc(v4)  # the clone changed in place
                current, owned = v4, True
            if _on(pipeline, "gamma"):
                alloc(2 * v4)  # x - min, then the choice between it and x
                free(v4 + current)
                current, owned = v4, True
            if _on(pipeline, "noise"):
                if not owned:
                    alloc(v4)
                    current = v4
                # the counters shared by the samples, their hashes and a shifted copy
                alloc(numel[k] * 16 + numel[k] // first[0] * 8)
                free(numel[k] * 16 + numel[k] // first[0] * 8)
            if floating and dtypes[k] != torch.float32:
                alloc(numel[k] * size[k])
            free(current)
    return tally.peak
