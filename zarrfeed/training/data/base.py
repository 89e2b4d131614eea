"""What every zarrfeed Dataset shares: the manifest it reads, the store opened lazily in each
process, the shared decoded-array cache, the optional sample transform, and what the block
sampler needs to know.

A sample is a dict of tensors (and ints) that ``torch.utils.data.default_collate`` batches, so
a plain ``DataLoader`` works.  Datasets with a batched read return from ``__getitems__`` the
samples as rows of one batch (:class:`BatchSamples`); :func:`collate_batch` hands that batch
on without copying it (``make_loader`` passes it, and tells its workers to read batches
straight into shared memory), where ``default_collate`` copies it once more.

Every index is a handful of flat numpy arrays built from the dataset manifests and the
consolidated tables that the ``datasets`` assets write (no per-sample Python objects, which
workers would copy on read).  Stores open lazily in each process, so datasets pickle to
spawned workers and survive fork after the parent has read the store.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from zarrfeed.datasets import open_dataset, snapshots
from zarrfeed.errors import StoreError
from zarrfeed.processlocal import ProcessLocal
from zarrfeed.store import ZarrStore
from zarrfeed.training.augment import Augment, AugmentConfig
from zarrfeed.training.data.protocols import WorkerSettings
from zarrfeed.training.data.reader import CachedArrays, Region
from zarrfeed.training.data.regimes import cached_arrays
from zarrfeed.training.data.ring import RELEASE, BatchRing

GB = 1 << 30
TRANSFORM_STREAM = 1  # rng stream of the transforms (0: crops and defects)


class BatchSamples(Sequence):
    """The samples of a batch read at once: sample ``i`` is a dict of row ``i`` of each of the
    batch's tensors (views, made when asked for), so ``default_collate`` batches them like
    any samples, and :func:`collate_batch` takes the batch itself without touching them."""

    def __init__(self, batch: dict[str, Any], size: int) -> None:
        self.batch, self.size = batch, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, row: Any) -> Any:
        if isinstance(row, slice):
            return [self[i] for i in range(*row.indices(self.size))]
        if not -self.size <= row < self.size:
            raise IndexError(f"sample {row} of a batch of {self.size}")
        return {k: v[row] for k, v in self.batch.items() if k != RELEASE}


def collate_batch(batch: Sequence[Any]) -> Any:
    """``default_collate``, except that the samples of a batch read at once
    (:class:`BatchSamples`) come back as that batch, without a copy.  (A loader that hands
    batches on this way tells its workers to read them straight into shared memory:
    :class:`~zarrfeed.training.data.protocols.WorkerSettings`.)"""
    if not isinstance(batch, BatchSamples):
        return default_collate(batch)
    return batch.batch


def plain(value: Any) -> Any:
    """Tensors as plain ``torch.Tensor`` (MONAI returns its ``MetaTensor``), numpy arrays as
    tensors, recursively: what ``default_collate`` and pinning handle the same way."""
    if isinstance(value, torch.Tensor):
        return value if type(value) is torch.Tensor else value.as_subclass(torch.Tensor)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


class StoreDataset(Dataset):
    """Lazily opened store + shared cache; subclasses define the index and :meth:`load`.

    ``augment`` (an :class:`~zarrfeed.training.augment.Augment`, or its config or mapping:
    ``{"recipe": "ct"}``) is the declared batched augmentation: every sample read goes
    through its ``apply_sample`` with (seed, epoch, index), and a device tier that cuts the
    batches itself applies it to each batch on the device, with the same result.
    ``transform`` (a callable on the sample dict: MONAI or TorchIO dictionary transforms, a
    ``Compose`` of them, any function) runs on every sample after it is cut from the cache.
    A sample never shares memory with the cache (every read copies), so a transform that
    works in place cannot corrupt it.  Random transforms are seeded per (seed, epoch, index):
    MONAI's through ``set_random_state``, others through torch's, numpy's and Python's
    global generators, saved and restored around the call.
    """

    dataset: str = ""
    asset: str = ""  # the asset whose arrays are cached

    def __init__(
        self,
        store: str | ZarrStore,
        cache_gb: float = 2.0,
        seed: int = 0,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        dataset_version: str | None = None,
        augment: Augment | AugmentConfig | Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(store, ZarrStore):
            self.url = store.url
            self.storage_options = getattr(store.backend, "storage_options", None)
        else:
            self.url, self.storage_options = str(store), None
        self.seed, self.budget_bytes = seed, int(cache_gb * GB)
        self.transform = transform
        self.augment = as_augment(augment)
        # In a loader worker, what its loader says (configure_worker): whether batched reads
        # go straight into shared memory, and how many batch slots they reuse (0: none).
        self.shared_batches = False
        self.batch_ring = 0
        self._ring: BatchRing | None = None
        # This process's epoch; loader workers take it from each index (training.data.epochs)
        self.epoch = 0
        self._store = ProcessLocal(partial(ZarrStore, self.url, self.storage_options))
        build = (
            f"build it with `zarrfeed demo`, or `dg launch -m zarrfeed.definitions --job "
            f"datasets_build` once the {self.dataset} partitions are built (`zarrfeed status`)"
        )
        if dataset_version is None and snapshots(self.store).pointer(self.dataset) is None:
            raise StoreError(f"{self.url} has no {self.dataset}_dataset manifest yet: {build}")
        manifest, lease = open_dataset(self.store, self.dataset, dataset_version)
        # Released by close() or when the dataset goes, whichever comes first; only once (a
        # second release is another remote delete, retried for minutes once a server is gone).
        # None in a spawned worker (see __getstate__): it reads under its parent's lease.
        self._release: weakref.finalize | None = weakref.finalize(self, lease.release)
        self.dataset_version: str = manifest["id"]
        self.tables: dict[str, str] = manifest.get("tables") or {}
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
        return self._store.get()

    def __getstate__(self) -> dict[str, Any]:
        # A spawned worker reads under its parent's lease.
        return {**self.__dict__, "_ring": None, "_release": None}

    def close(self) -> None:
        """Give up the lease on the dataset version (its versions may then be collected)."""
        if self._release is not None:
            self._release()

    def read_table(
        self, path: str, name: str, arrays: list[str]
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Arrays and attributes of the dataset's table ``name`` (stored under ``path``) at
        the version this dataset version pins, refused unless it was written for this
        manifest (its keys, and the versions of the partitions it gathers): a table of
        another build would pair rows with the wrong samples."""
        found, attrs = self.store.read_partition(path, name, arrays, self.tables.get(name))
        source = self.manifest_assets.get(attrs.get("source_asset", ""))
        stale = attrs.get("keys") != self.keys or (
            source is not None
            and attrs.get("versions") != [p["version"] for p in source["partitions"]]
        )
        if stale:
            raise StoreError(
                f"{path}/{name} of {self.url} was written for another build of the "
                f"{self.dataset} dataset than its manifest (a dataset build still writing, "
                "or one that stopped between its manifest and its tables): open the dataset "
                "again once the build ends, or rebuild it (the datasets_build job)"
            )
        return found, attrs

    def pinned_attrs(self, asset: str, items: Sequence[int]) -> list[dict[str, Any]]:
        """Attributes of partitions ``items`` of ``asset`` at the versions the manifest lists.

        The dataset's shapes, tables and cached bytes are those versions': a partition
        rebuilt since (another patch size, grid or binning) would not match them.  Its
        current commit record serves when it names the listed version; otherwise the listed
        version is opened, and a version removed since fails naming the partition."""
        partitions = self.manifest_assets[asset]["partitions"]
        keys = [partitions[i]["key"] for i in items]
        records = self.store.commit_records(asset, keys)
        found = []
        for i, key in zip(items, keys, strict=True):
            record, version = records[key], partitions[i]["version"]
            if record is not None and version == record["version"]:
                found.append(record["attrs"])
            else:
                found.append(dict(self.store.open_partition(asset, key, version).attrs))
        return found

    @cached_property
    def cache(self) -> CachedArrays:
        """The decoded arrays (in RAM when they fit ``cache_gb``, else chunk by chunk)."""
        return cached_arrays(self.store, self.sources(), self.budget_bytes)

    def sources(self) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
        """Asset → (manifest partitions, cached array names)."""
        return {self.asset: (self.partitions, self.cached_names())}

    def set_epoch(self, epoch: int) -> None:
        """Random crops and defects depend on (seed, epoch, index): reproducible per epoch.

        Call it before iterating the loader for that epoch: ``make_loader``'s loaders hand
        their workers (persistent ones too) each index with the epoch set here.
        """
        self.epoch = int(epoch)

    def device_refusal(self) -> str | None:
        """Why the device tier cannot cut this dataset's batches (None: nothing here stops
        it; a dataset it can cut also names its boxes: ``DeviceCuttable``)."""
        if self.transform is not None:
            return "its transform= runs per sample on the host: the DataLoader path applies it"
        return None

    def configure_worker(self, settings: WorkerSettings) -> None:
        """Take the settings a loader gives its workers (in the worker's copy only)."""
        self.batch_ring, self.shared_batches = settings.ring_slots, settings.shared_batches

    def rng(self, index: int, stream: int = 0) -> np.random.Generator:
        """The generator of sample ``index`` this epoch; ``stream`` tells independent uses of
        it apart (crops, patch placement, transforms)."""
        key = [self.seed, self.epoch, index] + ([stream] if stream else [])
        return np.random.default_rng(key)

    # samples --------------------------------------------------------------------------------
    def load(self, index: int) -> dict[str, Any]:
        """Sample ``index`` before the transform: a dict of new tensors (and ints)."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.guarded(index, lambda: self.finish(index, self.load(index)))

    @property
    def per_sample(self) -> bool:
        """Whether each sample read goes on through the augmentation or the transform
        (:meth:`finish`): a batched read then hands on its samples, not its batch."""
        return self.augment is not None or self.transform is not None

    def finish(self, index: int, sample: dict[str, Any]) -> dict[str, Any]:
        """``sample`` through the augmentation, then the transform, each seeded for
        (seed, epoch, index)."""
        if self.augment is not None:
            sample = self.augment.apply_sample(sample, self.seed, self.epoch, index)
        if self.transform is None:
            return sample
        out = seeded_call(self.transform, sample, self.rng(index, TRANSFORM_STREAM))
        if not isinstance(out, dict):
            raise TypeError(
                f"transform {self.transform!r} returned a {type(out).__name__}, not the sample "
                "dict (a transform that makes several samples, such as MONAI's num_samples > 1, "
                "does not fit one index)"
            )
        return plain(out)

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
        """Decode every cached array into the shared cache (automatic when it fits the budget), in
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

    def guarded(self, index: int, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, naming the partition being read when it fails (in a worker too)."""
        try:
            return fn()
        except Exception as exc:
            raise RuntimeError(
                f"{type(self).__name__}[{index}] failed reading {self.asset} of {self.url}: {exc}"
            ) from exc


def as_augment(augment: Augment | AugmentConfig | Mapping[str, Any] | None) -> Augment | None:
    """``augment`` as an :class:`Augment` (a config or a mapping is validated; None: none)."""
    if augment is None or isinstance(augment, Augment):
        return augment
    return Augment(augment)


def seeded_call(transform: Callable[[Any], Any], sample: Any, rng: np.random.Generator) -> Any:
    """``transform(sample)`` with its randomness drawn from ``rng`` alone.

    MONAI transforms (and their ``Compose``) carry their own generators, reseeded through
    ``set_random_state``; torch's, numpy's and Python's global generators (TorchIO draws from
    torch's) are seeded too, and restored afterwards so the caller's sequence is untouched.
    """
    seeds = rng.integers(0, 2**31, size=3)
    if hasattr(transform, "set_random_state"):
        transform.set_random_state(seed=int(seeds[0]))
    # Other libraries' transforms draw from numpy's legacy global generator: seed that one.
    state = random.getstate(), np.random.get_state()  # noqa: NPY002
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seeds[1]))
        np.random.seed(int(seeds[2]))  # noqa: NPY002
        random.seed(int(seeds[2]))
        try:
            return transform(sample)
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])  # noqa: NPY002
