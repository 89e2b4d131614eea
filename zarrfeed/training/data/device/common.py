"""What both device regimes share: array dtypes as the device holds them, small host tables
sent up through pinned memory, and the batch's boxes turned into index arithmetic."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zarrfeed.training.data.protocols import (
    Boxes,
    BoxSpec,
    DeviceCuts,
    DeviceCuttable,
    StoreBacked,
)
from zarrfeed.training.data.units import ArrayGroup

# How the device holds each array dtype: torch gathers no uint16, so those arrays travel and
# sit as int16 bits, viewed back as uint16 once cut.
_HELD = {
    "f2": torch.float16, "f4": torch.float32, "f8": torch.float64, "u1": torch.uint8,
    "i1": torch.int8, "i2": torch.int16, "u2": torch.int16, "i4": torch.int32,
    "i8": torch.int64, "b1": torch.bool,
}  # fmt: skip


def held_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype the device holds arrays of numpy ``dtype`` in."""
    code = np.dtype(dtype).str[1:]
    if code not in _HELD:
        raise ValueError(f"the device tier holds no {np.dtype(dtype)} arrays")
    return _HELD[code]


def held_view(array: np.ndarray) -> np.ndarray:
    """``array`` viewed as the device holds it (uint16 as int16 bits)."""
    return array.view(np.int16) if array.dtype == np.uint16 else array


def restored(cut: torch.Tensor, dtype: np.dtype) -> torch.Tensor:
    """A cut tensor viewed as the array's own dtype again."""
    return cut.view(torch.uint16) if np.dtype(dtype) == np.uint16 else cut


def pinned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host staging: pinned when it feeds a CUDA device (the copy is then asynchronous, and
    torch's pinned allocator keeps the block until that copy has finished)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host table on ``device``, through pinned memory on CUDA (the host never
    waits for the copy: it is ordered on the current stream before what reads it)."""
    host = torch.from_numpy(np.ascontiguousarray(held_view(np.asarray(array))))
    if device.type != "cuda":
        return host.to(device, copy=True)
    staged = pinned(tuple(host.shape), host.dtype, device)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)


def along(term: torch.Tensor, axis: int, dims: int) -> torch.Tensor:
    """Per-axis term ``(n, size)`` shaped to broadcast along ``axis`` of ``dims`` box axes."""
    shape = [term.shape[0]] + [1] * dims
    shape[1 + axis] = term.shape[1]
    return term.view(shape)


def grid(terms: list[torch.Tensor]) -> torch.Tensor:
    """Sum of per-axis terms ``(n, size_a)`` broadcast to ``(n, size_0, …, size_last)``."""
    out = along(terms[0], 0, len(terms))
    for axis in range(1, len(terms)):
        out = out + along(terms[axis], axis, len(terms))
    return out


def c_strides(shapes: np.ndarray) -> np.ndarray:
    """Element strides of C-ordered arrays of ``shapes`` (one row per array)."""
    tail = np.cumprod(shapes[:, :0:-1], axis=1)[:, ::-1]
    return np.concatenate([tail, np.ones((len(shapes), 1), np.int64)], axis=1)


class CutSource:
    """A dataset's batches as boxes of its cached arrays, cut on ``device``: the boxes are
    checked against the arrays' shapes on the host, sent up as one table per batch key, and
    the cut boxes handed to the dataset's ``device_finish`` with the batch's extras."""

    def __init__(self, dataset: Any, device: torch.device) -> None:
        name = type(dataset).__name__
        if not (isinstance(dataset, DeviceCuttable) and isinstance(dataset, StoreBacked)):
            raise ValueError(
                f"the device tier cuts store-backed datasets that name their batches' boxes "
                f"(DeviceCuttable); {name} does not"
            )
        why = dataset.device_refusal()
        if why is not None:
            raise ValueError(f"the device tier cannot cut the batches of {name}: {why}")
        self.dataset, self.device = dataset, device
        self.specs: dict[str, BoxSpec] = dataset.device_specs()
        self.groups: dict[str, ArrayGroup] = {
            key: dataset.cache.groups[s.asset, s.name] for key, s in self.specs.items()
        }
        self._steps = {
            key: [torch.arange(n, device=device) for n in s.shape] for key, s in self.specs.items()
        }

    def cuts(self, indices: np.ndarray) -> DeviceCuts:
        """The dataset's boxes of ``indices`` this epoch, each checked to lie in its array."""
        found = self.dataset.device_cuts(np.asarray(indices, np.int64))
        if set(found.boxes) != set(self.specs):
            raise ValueError(
                f"{type(self.dataset).__name__} cut boxes for {sorted(found.boxes)}; its "
                f"device specs name {sorted(self.specs)}"
            )
        for key, boxes in found.boxes.items():
            self._check(key, boxes)
        return found

    def _check(self, key: str, boxes: Boxes) -> None:
        g, shape = self.groups[key], np.asarray(self.specs[key].shape, np.int64)
        if not len(boxes.items):
            return
        ends = boxes.origins + shape
        bad = (boxes.origins < 0).any(axis=1) | (ends > g.shapes[boxes.items]).any(axis=1)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            item = int(boxes.items[row])
            raise ValueError(
                f"{type(self.dataset).__name__}: the {key!r} box of {tuple(shape.tolist())} at "
                f"{tuple(boxes.origins[row].tolist())} lies outside {g.name} of {g.asset}/"
                f"{g.keys[item]}, of shape {tuple(g.shapes[item].tolist())}"
            )

    def boxes_up(self, boxes: Boxes) -> tuple[torch.Tensor, torch.Tensor]:
        """(items, origins) of ``boxes`` on the device, in one staged copy."""
        table = np.concatenate(
            [np.asarray(boxes.items, np.int64)[:, None], np.asarray(boxes.origins, np.int64)],
            axis=1,
        )
        up = to_device(table, self.device)
        return up[:, 0], up[:, 1:]

    def axes(self, key: str, origins: torch.Tensor) -> list[torch.Tensor]:
        """Element coordinates of each box along each axis: ``(n, size)`` per axis."""
        return [origins[:, a, None] + step for a, step in enumerate(self._steps[key])]

    def finish(self, cut: dict[str, torch.Tensor], cuts: DeviceCuts) -> dict[str, Any]:
        extras = {k: restored(to_device(v, self.device), v.dtype) for k, v in cuts.extras.items()}
        return self.dataset.device_finish(cut, extras)
