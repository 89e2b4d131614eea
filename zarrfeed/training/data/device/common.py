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


def to_device_all(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Small host tables on ``device`` in one copy (:func:`to_device`): each one's bytes at
    an 8-byte boundary of one buffer, viewed back as its dtype and shape there."""
    held = [np.ascontiguousarray(held_view(np.asarray(a))) for a in arrays]
    starts = np.concatenate([[0], np.cumsum([-(-a.nbytes // 8) * 8 for a in held])])
    buffer = np.empty(max(8, int(starts[-1])), np.uint8)
    for a, start in zip(held, starts.tolist(), strict=False):
        buffer[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)
    up = to_device(buffer, device)
    return [
        up[start : start + a.nbytes].view(torch.from_numpy(a).dtype).view(a.shape)
        for a, start in zip(held, starts.tolist(), strict=False)
    ]


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


def gather(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``flat[index]`` for a 1-D ``flat``, shaped as ``index``: one ``index_select`` over
    the flattened index.  For a batch's index it is an order of magnitude faster on a CPU
    than ``take`` or advanced indexing (measured on 2 cores: ~1.5 ms against 17-34 ms for
    a million elements), and it refuses a negative index where ``take`` would wrap it."""
    return flat.index_select(0, index.reshape(-1)).view(index.shape)


def c_strides(shapes: np.ndarray) -> np.ndarray:
    """Element strides of C-ordered arrays of ``shapes`` (one row per array)."""
    tail = np.cumprod(shapes[:, :0:-1], axis=1)[:, ::-1]
    return np.concatenate([tail, np.ones((len(shapes), 1), np.int64)], axis=1)


class CutSource:
    """A dataset's batches as boxes of its cached arrays, cut on ``device``: the boxes are
    checked against the arrays' shapes on the host and sent up with the batch's extras in
    one copy; the regimes cut them and hand them to the dataset's ``device_finish``."""

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

    def up(
        self, cuts: DeviceCuts
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        """The batch's boxes — (items, origins) per batch key — and its extras on the
        device, all in one staged copy."""
        tables = [
            np.concatenate([np.asarray(b.items, np.int64)[:, None],
                            np.asarray(b.origins, np.int64)], axis=1)
            for b in cuts.boxes.values()
        ]  # fmt: skip
        up = to_device_all(tables + list(cuts.extras.values()), self.device)
        boxes = {key: (t[:, 0], t[:, 1:]) for key, t in zip(cuts.boxes, up, strict=False)}
        extras = {
            key: restored(t, v.dtype)
            for (key, v), t in zip(cuts.extras.items(), up[len(tables) :], strict=True)
        }
        return boxes, extras

    def axes(self, key: str, origins: torch.Tensor) -> list[torch.Tensor]:
        """Element coordinates of each box along each axis: ``(n, size)`` per axis."""
        return [origins[:, a, None] + step for a, step in enumerate(self._steps[key])]
