"""The dataset fits the device budget: every array its batches cut from lives on the
device, partition after partition in one flat tensor per array."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from zarrfeed.training.data.device.common import (
    CutSource,
    c_strides,
    grid,
    held_dtype,
    held_view,
    restored,
    to_device,
)


class DevicePatches(CutSource):
    """A dataset's cached arrays (those its device specs cut from) whole on ``device``."""

    def __init__(self, dataset: Any, device: torch.device) -> None:
        super().__init__(dataset, device)
        self._flat: dict[tuple[str, str], torch.Tensor] = {}
        self._tables: dict[tuple[str, str], torch.Tensor] = {}
        cache = dataset.cache
        for g in {(g.asset, g.name): g for g in self.groups.values()}.values():
            shapes = g.shapes.astype(np.int64)
            starts = np.concatenate([[0], np.cumsum(np.prod(shapes, axis=1))])
            flat = torch.empty(int(starts[-1]), dtype=held_dtype(g.dtype), device=device)
            with warnings.catch_warnings():  # cache entries are read-only; copy_ only reads
                warnings.simplefilter("ignore", UserWarning)
                for i in range(len(shapes)):
                    array = held_view(cache.array(g.asset, i, g.name))
                    flat[int(starts[i]) : int(starts[i + 1])].copy_(
                        torch.from_numpy(array).reshape(-1)
                    )
            # per partition: where it starts in the flat tensor, then its element strides
            # (but the last, 1)
            table = np.concatenate([starts[:-1, None], c_strides(shapes)[:, :-1]], axis=1)
            self._flat[g.asset, g.name] = flat
            self._tables[g.asset, g.name] = to_device(table, device)

    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self._flat.values())

    def batch(self, indices: np.ndarray) -> dict[str, Any]:
        """The same batch as the dataset's DataLoader path yields for ``indices``, each
        array's boxes cut on the device by one gather (the copies and kernels go to the
        current stream)."""
        boxes, extras = self.up(self.cuts(indices))
        cut = {}
        for key, (items, origins) in boxes.items():
            g = self.groups[key]
            row = self._tables[g.asset, g.name][items]
            axes = self.axes(key, origins)
            terms = [axes[a] * row[:, 1 + a, None] for a in range(len(axes) - 1)] + [axes[-1]]
            terms[0] = terms[0] + row[:, 0, None]
            cut[key] = restored(self._flat[g.asset, g.name].take(grid(terms)), g.dtype)
        return self.dataset.device_finish(cut, extras)
