"""The dataset fits its budget: each array is decoded whole into a
:class:`~zarrfeed.training.data.arrays.SharedArrayCache` entry (before the workers start, by
:meth:`InRamArrays.preload`), and a sample is one slice of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from zarrfeed.processes import usable_cpus
from zarrfeed.store import ZarrStore
from zarrfeed.training.data.arrays import Fill, SharedArrayCache
from zarrfeed.training.data.reader import CachedArrays, Request
from zarrfeed.training.data.units import Region, UnitIndex


class InRamArrays(CachedArrays):
    """Whole decoded arrays, one shared-memory entry each, keyed by :meth:`entry_key`."""

    in_ram = True

    def __init__(self, store: ZarrStore, units: UnitIndex, budget_bytes: int) -> None:
        super().__init__(store, units, budget_bytes)
        self.entries = SharedArrayCache(self.arrays, self.budget_bytes, self.meta)

    @property
    def tier(self) -> SharedArrayCache:
        return self.entries

    @property
    def capacity_bytes(self) -> int:
        return self.budget_bytes

    def _fill(self, asset: str, item: int, name: str, threads: int | None = None) -> Fill:
        g = self.groups[asset, name]
        shape = tuple(int(n) for n in g.shapes[item])

        def into(out: np.ndarray) -> np.ndarray:
            return self.chunked(asset, item, name).read_into(out, threads)

        return Fill(shape, g.dtype, into)

    def array(self, asset: str, item: int, name: str) -> np.ndarray:
        """All of an array: read-only shared memory."""
        return self.entries.get(self.entry_key(asset, item, name), self._fill(asset, item, name))

    def preload(self) -> None:
        """Decode every array into the cache, evicting entries of other versions.

        Arrays are filled side by side, one per usable core: a fill is half kernel work on
        fresh shared memory (allocating and mapping its pages, one core) and half decoding,
        so one fill at a time leaves a core idle for half of the time.
        """
        arrays = [(a, item, n) for (a, n), g in self.groups.items() for item in range(len(g.keys))]

        def fill(array: tuple[str, int, str]) -> str:
            key = self.entry_key(*array)
            self.entries.get(key, self._fill(*array, threads=1))
            return key

        threads = usable_cpus()
        if threads > 1 and len(arrays) > 1:
            keys = set(self._pool(threads).map(fill, arrays))
        else:
            keys = {fill(array) for array in arrays}
        self.entries.drop_others(keys)

    def read_into(self, requests: Sequence[Request], threads: int = 1) -> None:
        """Copy each request's region into its destination: one lookup per array (one
        LRU-clock update and one statistics update), then one copy per region, on up to
        ``threads`` threads."""
        if not requests:
            return
        by_array: dict[tuple[str, int, str], list[tuple[Region, np.ndarray]]] = {}
        for asset, item, name, region, out in requests:
            by_array.setdefault((asset, item, name), []).append((region, out))
        keys = self._local.get().keys
        copies: list[tuple[torch.Tensor, Region, np.ndarray]] = []
        for (asset, item, name), regions in by_array.items():
            key = keys.get((asset, item, name))
            if key is None:
                key = keys[asset, item, name] = self.entry_key(asset, item, name)
            whole = self.entries.tensor(key, reads=len(regions))
            if whole is None:
                filled = self.entries.get(key, self._fill(asset, item, name), wait=False)
                whole = None if filled is None else self.entries.tensor(key, reads=0)
            if whole is None:  # another process is decoding it: read just these parts
                data = self.chunked(asset, item, name)
                for region, out in regions:
                    data.read_region_into(region, out)
                continue
            copies += [(whole, region, out) for region, out in regions]
        # Torch copies a strided 3-D region ~1.4x faster than numpy, and spreads each copy
        # over its own intra-op threads when it has several: copy threads of ours only when
        # it has one (DataLoader workers), or they would each start a team of its threads.
        threads = min(threads, len(copies)) if torch.get_num_threads() == 1 else 1
        if threads > 1:
            list(
                self._pool(threads).map(_copy_regions, [copies[i::threads] for i in range(threads)])
            )
        else:
            _copy_regions(copies)

    def prefetch(
        self,
        ids: np.ndarray,
        wanted: Callable[[], bool] = lambda: True,
        keep: np.ndarray | None = None,
    ) -> None:
        """Decode the arrays units ``ids`` lie in that are not cached yet."""
        done = set()
        for g, item, _ in self.units.locate(ids):
            if not wanted():
                return
            if (g.asset, item, g.name) not in done:
                done.add((g.asset, item, g.name))
                self.array(g.asset, item, g.name)

    def read_ahead(self, ids: np.ndarray, wanted: Callable[[], bool] = lambda: True) -> None:
        """Nothing: whole arrays come in by :meth:`prefetch` (or the preload)."""

    def stats(self) -> dict[str, Any]:
        return {**self.entries.stats(), "regime": "in RAM (whole arrays)"}


def _copy_regions(copies: Sequence[tuple[torch.Tensor, Region, np.ndarray]]) -> None:
    for whole, region, out in copies:
        torch.from_numpy(out).copy_(whole[region])
