"""What a dataset and a batch source may provide, as typed protocols.

The loader, the feed and the samplers work with any ``torch`` Dataset; these protocols name
the optional abilities they use when a dataset has them (a store-backed cache, an epoch,
batched reads, its own collate, settings applied in each worker, batches the device tier
can cut), what an epoch order provides, and what a patch sampler provides and reads of
the dataset it places patches for.  They are checked with ``isinstance`` in one
place each, never by probing for attribute names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from zarrfeed.store import ZarrStore

# What every cache tier's stats() counts, under these names (each tier may add its own).
TIER_STATS = (
    "hits",
    "misses",
    "bytes_decoded",
    "evictions",
    "entries",
    "bytes_held",
    "budget_bytes",
)


@runtime_checkable
class CacheTier(Protocol):
    """One tier of the cache — device slots, whole arrays in RAM, the out-of-core arena, the
    local-disk tier — as the planner, the commands and the benchmarks see it: its byte budget,
    what it can hold at once, its statistics under the names :data:`TIER_STATS` (besides its
    own), and a way to empty it for every process and to let go of this process's hold."""

    budget_bytes: int

    @property
    def capacity_bytes(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


class CacheFacts(Protocol):
    """What planning reads of a dataset's decoded-array cache."""

    in_ram: bool  # every cached array fits the budget (else chunk by chunk, out of core)
    nbytes: int  # decoded bytes of every cached array
    budget_bytes: int
    identity: str

    @property
    def capacity_bytes(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class StoreBacked(Protocol):
    """A dataset over a store with a byte-budgeted cache: it can be preloaded, and a block
    sampler can keep its working set inside the cache (sample → partition → cache units)."""

    @property
    def cache(self) -> Any: ...

    def preload(self) -> None: ...

    def sample_items(self) -> np.ndarray: ...

    def sample_units(self, indices: np.ndarray) -> np.ndarray: ...

    def partition_bytes(self) -> np.ndarray: ...


@dataclass(frozen=True)
class BoxSpec:
    """What one sample cuts from one cached array (``asset``, ``name``): at most ``count``
    boxes of ``shape`` elements (a box per axis of the array)."""

    asset: str
    name: str
    shape: tuple[int, ...]
    count: int = 1


@dataclass(frozen=True)
class Boxes:
    """The boxes one batch cuts from one cached array, one row each: the partition it lies
    in and its first element (``(n, ndim)``, int64), as the host path reads them."""

    items: np.ndarray
    origins: np.ndarray


@dataclass(frozen=True)
class DeviceCuts:
    """One batch as the device tier cuts it: boxes by batch key (of the arrays
    :meth:`DeviceCuttable.device_specs` names) and small host arrays that go up with them
    (labels, item ids, defect parameters)."""

    boxes: dict[str, Boxes]
    extras: dict[str, np.ndarray]


@runtime_checkable
class DeviceCuttable(Protocol):
    """A dataset whose batches the device tier can cut from its cached arrays held on the
    training device: per batch key the boxes its samples read this epoch, and what turns
    the cut boxes (``(n, *shape)`` tensors, the arrays' dtypes) into the batch its
    DataLoader path yields for the same indices."""

    def device_refusal(self) -> str | None:
        """Why its batches cannot be cut on the device (None: they can)."""
        ...

    def device_specs(self) -> dict[str, BoxSpec]: ...

    def device_cuts(self, indices: np.ndarray) -> DeviceCuts: ...

    def device_finish(
        self, cut: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]
    ) -> dict[str, Any]: ...


@runtime_checkable
class EpochAware(Protocol):
    """A dataset whose samples depend on (seed, epoch, index): random crops, placements,
    defects and transforms move on with the epoch."""

    epoch: int

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class BatchedReads(Protocol):
    """A dataset that reads a whole batch at once (``DataLoader`` calls ``__getitems__``)."""

    def __getitems__(self, indices: list[int]) -> Sequence[Any]: ...


@runtime_checkable
class Collating(Protocol):
    """A dataset that names the collate function its samples need."""

    collate: Callable[[Sequence[Any]], Any]


@runtime_checkable
class HoldsOut(Protocol):
    """A dataset that holds samples out of training for evaluation: ``keys`` are every
    partition of its manifest, ``eval_keys`` those held out, ``split`` which side it keeps
    ("train", "eval", or None for both)."""

    keys: list[str]
    eval_keys: list[str]
    split: str | None


@dataclass(frozen=True)
class WorkerSettings:
    """What a loader worker's copy of the dataset is told when the worker starts.

    ``ring_slots``: batch slots of shared memory the worker reuses (0: none; only a consumer
    that frees them, the training feed, asks for them); ``shared_batches``: read batches
    straight into shared memory, worth it only when the collate hands the batch on whole
    (``collate_batch``), since ``default_collate`` copies it anyway."""

    ring_slots: int = 0
    shared_batches: bool = False


@runtime_checkable
class WorkerConfigurable(Protocol):
    """A dataset that takes :class:`WorkerSettings` in each loader worker."""

    def configure_worker(self, settings: WorkerSettings) -> None: ...


@runtime_checkable
class Ordering(Protocol):
    """An epoch order that can start mid-epoch and says why it was chosen."""

    reason: str

    def set_epoch(self, epoch: int, start: int = 0) -> None: ...

    def __iter__(self) -> Iterator[int]: ...

    def __len__(self) -> int: ...


@runtime_checkable
class PatchSource(Protocol):
    """What a patch sampler reads of the dataset it places patches for: which volume each
    sample reads (``items``, indices into ``keys``), the patch shape and the stored origins
    (``origins``, one per sample), the cached window and its volumes' shapes, each sample's
    random streams, and for placements on the stored occupancy the manifest's assets
    (``manifest_assets``, of manifest ``dataset``), the asset naming ``occupancy`` and the
    store they are read from.  ``asset`` and ``url`` name it in errors."""

    dataset: str
    asset: str
    url: str
    keys: list[str]
    items: np.ndarray
    origins: np.ndarray
    patch_shape: tuple[int, ...]
    window: str
    occupancy: str
    manifest_assets: dict[str, Any]

    @property
    def store(self) -> ZarrStore: ...

    def shape_of(self, item: int, name: str) -> tuple[int, ...]: ...

    def rng(self, index: int, stream: int = 0) -> np.random.Generator: ...


@runtime_checkable
class PatchSampling(Protocol):
    """Where each sample's patch is cut in its volume, repeatably for (seed, epoch, index).

    ``bind`` attaches it to its dataset (and refuses one whose volumes it cannot place a
    patch in); ``origins`` gives the ``(len(indices), ndim)`` int64 first voxels of those
    samples' patches this epoch; ``whole_volume`` says whether a patch may lie anywhere in
    its volume, so that a block sampler counts whole volumes rather than the stored
    patches' cache units."""

    whole_volume: bool

    def bind(self, dataset: PatchSource) -> None: ...

    def origins(self, indices: np.ndarray) -> np.ndarray: ...
