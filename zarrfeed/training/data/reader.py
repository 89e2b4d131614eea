"""The arrays a dataset reads, decoded once per machine into shared memory, read through the
store API only (local folders and object stores alike).

Two regimes behind one interface (:class:`CachedArrays`), picked from the dataset's decoded
size and its budget (:func:`~zarrfeed.training.data.regimes.cached_arrays`): whole arrays in
RAM (:mod:`~zarrfeed.training.data.inram`) when the dataset fits, stored chunks in an arena of
exactly the budget (:mod:`~zarrfeed.training.data.outofcore`) when it does not.

Every cached byte is keyed by what it is: the store's resolved location
(``ZarrStore.identity``), the asset, the partition, its committed version (from the dataset
manifest), the array (and out of core, the unit) — a rebuilt partition or another store can
never be served from an old entry.  Each array is checked against the manifest on first use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import get_worker_info

from zarrfeed.errors import StoreError
from zarrfeed.processes import usable_cpus
from zarrfeed.processlocal import ProcessLocal
from zarrfeed.store import ChunkedArray, ZarrStore
from zarrfeed.training.data.protocols import CacheTier
from zarrfeed.training.data.units import Region, UnitIndex, clip

HANDLES = 256  # stored arrays each process keeps open (one per partition and array name)
Request = tuple[str, int, str, Region, np.ndarray]  # asset, item, array, region, destination


class CachedArrays(ABC):
    """Decoded arrays of a dataset's partitions through one shared cache per machine.

    ``units`` indexes the arrays to cache (each asset's manifest partitions and array
    names).  Pickles to workers without handles: each process opens the store and maps the
    cache itself.
    """

    in_ram: bool  # every array fits the budget: whole arrays in RAM (else units, out of core)

    def __init__(self, store: ZarrStore, units: UnitIndex, budget_bytes: int) -> None:
        self.url, self.identity = store.url, store.identity
        self.storage_options = getattr(store.backend, "storage_options", None)
        self.budget_bytes = int(budget_bytes)
        self.units = units
        self.groups, self.nbytes = self.units.groups, self.units.nbytes
        self.unit_bytes = self.units.unit_bytes
        what = {a: sorted(n for b, n in self.groups if b == a) for a, _ in self.groups}
        self.arrays = f"{self.identity}|{sorted(what.items())}"  # what the cache holds
        self.meta = {"store": self.url, "identity": self.identity, "arrays": what}
        self._local = ProcessLocal(_Handles)

    @property
    @abstractmethod
    def tier(self) -> CacheTier:
        """The shared cache the arrays are held in."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes of decoded data the cache can hold at once."""

    def _pool(self, threads: int) -> ThreadPoolExecutor:
        local = self._local.get()
        if local.pool is None or local.pool[0] != threads:
            local.pool = (threads, ThreadPoolExecutor(threads, thread_name_prefix="zarrfeed-copy"))
        return local.pool[1]

    @property
    def store(self) -> ZarrStore:
        local = self._local.get()
        if local.store is None:
            local.store = ZarrStore(self.url, self.storage_options)
        return local.store

    def chunked(self, asset: str, item: int, name: str) -> ChunkedArray:
        """The stored array, pinned to the manifest's version and checked against it (the
        last :data:`HANDLES` opened stay open in each process)."""
        handles = self._local.get().arrays
        found = handles.pop((asset, item, name), None)
        if found is None:
            g = self.groups[asset, name]
            key = g.keys[item]
            found = self.store.chunked(asset, key, name, self._version(asset, item, name))
            want = tuple(int(n) for n in g.shapes[item])
            if found.shape != want or found.dtype != g.dtype:
                raise StoreError(
                    f"partition {asset}/{key} array {name!r} is {found.dtype} {found.shape}; "
                    f"the manifest says {g.dtype} {want}: rebuild the manifest"
                )
            while len(handles) >= HANDLES:
                handles.pop(next(iter(handles)))
        handles[asset, item, name] = found  # most recently used last
        return found

    def _version(self, asset: str, item: int, name: str) -> str:
        """The manifest's version of a partition."""
        return self.groups[asset, name].versions[item]

    def entry_key(self, asset: str, item: int, name: str) -> str:
        """What an in-RAM entry is: store identity, asset, partition, version, array."""
        key = self.groups[asset, name].keys[item]
        return f"{self.identity}\0{asset}\0{key}\0{self._version(asset, item, name)}\0{name}"

    # reading ----------------------------------------------------------------------------------
    @abstractmethod
    def array(self, asset: str, item: int, name: str) -> np.ndarray:
        """All of an array."""

    @abstractmethod
    def preload(self) -> None:
        """Decode every array before the workers start, where the regime holds whole arrays."""

    def read(self, asset: str, item: int, name: str, region: Region) -> np.ndarray:
        """A new array holding ``region`` (one slice per axis, steps of 1)."""
        g = self.groups[asset, name]
        region = clip(region, g.shapes[item])
        out = np.empty(tuple(s.stop - s.start for s in region), g.dtype)
        self.read_into([(asset, item, name, region, out)])
        return out

    @abstractmethod
    def read_into(self, requests: Sequence[Request], threads: int = 1) -> None:
        """Copy each request's region into its destination (region-shaped), on up to
        ``threads`` threads (:func:`copy_threads`: what this process may use)."""

    @abstractmethod
    def prefetch(
        self,
        ids: np.ndarray,
        wanted: Callable[[], bool] = lambda: True,
        keep: np.ndarray | None = None,
    ) -> None:
        """Decode what units ``ids`` need that is not cached (until ``wanted()`` is false):
        the block sampler calls it for the next block while this one is read; ``keep`` is
        the block being read, not to be evicted for it."""

    @abstractmethod
    def read_ahead(self, ids: np.ndarray, wanted: Callable[[], bool] = lambda: True) -> None:
        """Fetch what units ``ids`` need into the disk tier without decoding it, where the
        regime reads ahead (the block sampler calls it a whole block ahead)."""

    # statistics -------------------------------------------------------------------------------
    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Hits, misses, bytes decoded, evictions, entries and bytes held, budget, regime."""

    def clear(self) -> None:
        """Empty the cache for every process (its statistics too)."""
        self.tier.clear()

    def close(self) -> None:
        """Release this process's hold on the cache; an unused cache can then be swept."""
        self.tier.close()


@dataclass
class _Handles:
    """What one process opens to read: the store, its copy threads (and how many), the
    stored arrays it keeps open, and the unit keys and entry keys it worked out."""

    store: ZarrStore | None = None
    pool: tuple[int, ThreadPoolExecutor] | None = None
    arrays: dict[tuple[str, int, str], ChunkedArray] = field(default_factory=dict)
    bases: dict[tuple[str, int, str], tuple[int, int]] = field(default_factory=dict)
    keys: dict[tuple[str, int, str], str] = field(default_factory=dict)


def copy_threads() -> int:
    """Threads this process may copy a batch on: every usable core in the main process, and
    a DataLoader worker's share of them (its siblings copy side by side)."""
    info = get_worker_info()
    cores = usable_cpus()
    return cores if info is None else max(1, cores // info.num_workers)
