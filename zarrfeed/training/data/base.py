"""What every zarrfeed Dataset shares: the manifest it reads, the store opened lazily in each
process, the shared decoded-array cache, and what the block sampler needs to know.

Every index is a handful of flat numpy arrays built from the dataset manifests and the
consolidated tables that the ``datasets`` assets write (no per-sample Python objects, which
workers would copy on read).  Stores open lazily in each process, so datasets pickle to
spawned workers and survive fork after the parent has read the store.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from zarrfeed.errors import StoreError
from zarrfeed.store import ZarrStore
from zarrfeed.training.data.reader import CachedArrays, Region

GB = 1 << 30


def collate_batch(batch: Any) -> Any:
    """Collate for datasets whose ``__getitems__`` already returns a collated batch."""
    return batch if isinstance(batch, dict) else default_collate(batch)


class StoreDataset(Dataset):
    """Lazily opened store + shared cache; subclasses define the index and ``__getitem__``."""

    dataset: str = ""
    asset: str = ""  # the asset whose arrays are cached

    def __init__(self, store: str | ZarrStore, cache_gb: float = 2.0, seed: int = 0) -> None:
        if isinstance(store, ZarrStore):
            self.url = store.url
            self.storage_options = getattr(store.backend, "storage_options", None)
        else:
            self.url, self.storage_options = str(store), None
        self.seed, self.budget_bytes = seed, int(cache_gb * GB)
        # Shared with the workers (persistent ones too): set_epoch reaches them.
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._store: ZarrStore | None = None
        self._pid = os.getpid()
        build = (
            f"build it with `zarrfeed demo`, or `dg launch -m zarrfeed.definitions --job "
            f"datasets_build` once the {self.dataset} partitions are built (`zarrfeed status`)"
        )
        try:
            manifest = self.store.read_manifest(self.dataset)
        except StoreError:
            raise StoreError(
                f"{self.url} has no {self.dataset}_dataset manifest yet: {build}"
            ) from None
        self.keys: list[str] = manifest["keys"]
        if not self.keys:
            raise StoreError(
                f"the {self.dataset}_dataset manifest of {self.url} lists no complete sample "
                f"({', '.join(manifest['assets'])}): {build}"
            )
        self.partitions = manifest["assets"][self.asset]["partitions"]
        self.manifest_assets = manifest["assets"]

    @property
    def store(self) -> ZarrStore:
        if self._store is None or self._pid != os.getpid():
            self._store, self._pid = ZarrStore(self.url, self.storage_options), os.getpid()
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None}

    @cached_property
    def cache(self) -> CachedArrays:
        """The decoded arrays (in RAM when they fit ``cache_gb``, else chunk by chunk)."""
        return CachedArrays(self.store, self.sources(), self.budget_bytes)

    def sources(self) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
        """Asset → (manifest partitions, cached array names)."""
        return {self.asset: (self.partitions, self.cached_names())}

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Random crops and defects depend on (seed, epoch, index): reproducible per epoch.

        The epoch lives in shared memory, so persistent workers see the change; call it
        before iterating the loader for that epoch.
        """
        self._epoch[0] = epoch

    def own_epoch(self) -> None:
        """Give this process an epoch of its own, no longer shared with the other workers:
        a worker that is handed each batch's epoch sets it without changing its siblings'."""
        self._epoch = self._epoch.clone()

    def rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, index])

    def shape_of(self, item: int, name: str) -> tuple[int, ...]:
        return tuple(self.partitions[item]["arrays"][name]["shape"])

    def array(self, item: int, name: str) -> np.ndarray:
        """The decoded array ``name`` of partition ``item`` (read-only when shared)."""
        return self.cache.array(self.asset, item, name)

    def region(self, item: int, name: str, region: Region) -> np.ndarray:
        """A new array holding ``region`` of array ``name`` of partition ``item``."""
        return self.cache.read(self.asset, item, name, region)

    def cached_names(self) -> list[str]:
        return sorted(self.partitions[0]["arrays"])

    def nbytes(self) -> int:
        """Decoded bytes of every cached array: what preloading would take."""
        return self.cache.nbytes

    def preload(self) -> None:
        """Decode every cached array into the shared cache (seed 000's auto-preload), in
        this process: :meth:`ChunkedArray.read_into` decodes each array's chunks on every
        usable core straight into its cache file, faster than child processes start.  The
        cache is shared, so what is decoded here is what every worker then maps."""
        self.cache.preload()

    # what the block sampler needs ---------------------------------------------------------
    def sample_items(self) -> np.ndarray:
        """The partition of every sample."""
        return self.items

    def sample_units(self, indices: np.ndarray) -> np.ndarray:
        """Global ids of the cache units that samples ``indices`` read (all of their arrays
        unless a dataset knows better)."""
        items = self.sample_items()[indices]
        found = [
            self.cache.units.whole_units(a, names, items)
            for a, (_, names) in self.sources().items()
        ]
        return np.concatenate(found)

    def partition_bytes(self) -> np.ndarray:
        """Bytes of cache each partition's samples need at once (its working set)."""
        units = sum(
            self.cache.units.unit_counts(a, names) for a, (_, names) in self.sources().items()
        )
        return units.astype(np.int64) * self.cache.unit_bytes

    def guarded(self, index: int, fn: Callable[[], dict]) -> dict:
        """Run ``fn``, naming the partition being read when it fails (in a worker too)."""
        try:
            return fn()
        except Exception as exc:
            raise RuntimeError(
                f"{type(self).__name__}[{index}] failed reading {self.asset} of {self.url}: {exc}"
            ) from exc
