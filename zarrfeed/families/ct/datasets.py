"""Windowed CT: patches through the consolidated patch index, or whole volumes; and the
occupied-voxel coordinates of the sparse indices."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from zarrfeed.errors import StoreError
from zarrfeed.families.ct.family import CT, CT_PATCHES, CT_SPARSE, CT_WINDOWS, LABELS, PATCH_TABLE
from zarrfeed.store import ZarrStore
from zarrfeed.training.augment import Augment, AugmentConfig
from zarrfeed.training.data.base import BatchSamples, StoreDataset, collate_batch
from zarrfeed.training.data.device.pool import units_per_box
from zarrfeed.training.data.patches import make_patch_sampler
from zarrfeed.training.data.protocols import Boxes, BoxSpec, DeviceCuts, PatchSampling
from zarrfeed.training.data.reader import copy_threads
from zarrfeed.training.data.ring import RELEASE, BatchRing
from zarrfeed.transforms.sparse import sample_points, sample_rows

VALID_PREFIX = "valid_"  # CT-RATE names its validation scans valid_<patient>_<scan>_<recon>
HOLDOUT_SHARE = 4  # where the names mark no split: about one key in 4 is held out


def held_out(keys: Sequence[str]) -> np.ndarray:
    """Which of ``keys`` (a boolean mask) are held out of training for evaluation.

    CT-RATE's validation scans (names ``valid_…``), where some but not all keys are;
    otherwise about a quarter of the keys, chosen by a hash of the key (so a key keeps its
    side whatever other keys come or go), at least one where there are two or more.  A
    single key cannot be held out: it is trained on and scored, and the trainer says so.
    """
    keys = list(keys)
    valid = np.array([k.startswith(VALID_PREFIX) for k in keys], bool)
    if 0 < valid.sum() < len(keys):
        return valid
    mask = np.zeros(len(keys), bool)
    if len(keys) < 2:
        return mask
    digest = np.array([int(hashlib.sha256(k.encode()).hexdigest()[:8], 16) for k in keys])
    mask[digest % HOLDOUT_SHARE == 0] = True
    if not mask.any():
        mask[int(np.argmin(digest))] = True
    if mask.all():
        mask[int(np.argmax(digest))] = False
    return mask


_TORCH_DTYPES = {"f2": torch.float16, "f4": torch.float32, "u1": torch.uint8, "i2": torch.int16}


class CTPatchDataset(StoreDataset):
    """Windowed CT patches through the consolidated patch index, or whole volumes.

    ``patch=False`` yields whole volumes; otherwise each sample is one entry of the patch
    index built by ``ct_patches``: its volume, and by default its origin (mostly-body
    patches).  ``patch_sampler`` places the patch otherwise: "uniform" anywhere in the
    volume, "foreground" on the stored occupancy, or any
    :class:`~zarrfeed.training.data.protocols.PatchSampling` (see
    :mod:`zarrfeed.training.data.patches`).  CT-RATE labels come along as float32 0/1 (NaN
    where a scan has no label row).

    ``split`` keeps the samples of the scans trained on ("train") or of those held out for
    evaluation ("eval", see :func:`held_out`); None keeps every scan.  The index still
    numbers every key of the manifest (``keys``, ``items``); ``eval_keys`` names the held-out
    scans.

    A plain ``DataLoader`` batches the samples; ``__getitems__`` reads a whole batch at once
    into one buffer, and ``collate_fn=ds.collate`` (what ``make_loader`` passes) hands that
    buffer on without the copy ``default_collate`` makes.
    """

    dataset, asset = CT.name, CT_WINDOWS.path
    occupancy = CT_SPARSE.path  # the occupied cells of each window (foreground patches)
    collate = staticmethod(collate_batch)

    def __init__(
        self,
        store: str | ZarrStore,
        window: str = "lung",
        patch: bool = True,
        cache_gb: float = 2.0,
        seed: int = 0,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        patch_sampler: str | PatchSampling = "stored",
        dataset_version: str | None = None,
        split: str | None = None,
        augment: Augment | AugmentConfig | Mapping[str, Any] | None = None,
    ) -> None:
        if split not in (None, "train", "eval"):
            raise ValueError(f"split must be None, 'train' or 'eval', got {split!r}")
        super().__init__(store, cache_gb, seed, transform, dataset_version, augment)
        self.window, self.patch = window, patch
        if window not in self.partitions[0]["arrays"]:
            have = ", ".join(sorted(self.partitions[0]["arrays"]))
            raise StoreError(
                f"no window {window!r} in {self.asset} of {self.url}: it has {have} (set "
                "data.window to one of them, or add the window to ct_settings.windows and "
                "rebuild)"
            )
        if not patch and patch_sampler != "stored":
            raise ValueError(f"patch_sampler={patch_sampler!r} places patches: set patch=True")
        self.labels, self.label_names = self._labels()
        self.items = np.arange(len(self.keys), dtype=np.uint32)
        if patch:
            table, _ = self.read_table(CT.dataset_path, PATCH_TABLE.name, ["offsets", "origins"])
            self.items = np.repeat(self.items, np.diff(table["offsets"]))
            self.origins = table["origins"]
        evaluated = held_out(self.keys)
        self.split = split
        self.eval_keys = [k for k, e in zip(self.keys, evaluated, strict=True) if e]
        if split is not None and evaluated.any():
            keep = evaluated[self.items] == (split == "eval")
            self.items = self.items[keep]
            if patch:
                self.origins = self.origins[keep]
        if patch:
            attrs = self.pinned_attrs(CT_PATCHES.path, [0])[0]
            self.patch_shape = tuple(attrs["patch_shape"])
            self.patch_sampler = make_patch_sampler(patch_sampler)
            self.patch_sampler.bind(self)

    def cached_names(self) -> list[str]:
        return [self.window]

    def _labels(self) -> tuple[np.ndarray | None, list[str]]:
        if not self.store.has_partition(CT.dataset_path, LABELS):
            return None, []
        arrays, attrs = self.read_table(CT.dataset_path, LABELS, [LABELS])
        table = arrays[LABELS].astype(np.float32)
        table[table == attrs["unknown"]] = np.nan
        return table, list(attrs["names"])

    def __len__(self) -> int:
        return len(self.items)

    def patch_origins(self, indices: np.ndarray) -> np.ndarray:
        """(N, 3) int64 origins of samples ``indices``' patches this epoch (patch mode)."""
        return self.patch_sampler.origins(np.asarray(indices, np.int64))

    def _region(self, origin: np.ndarray) -> tuple[slice, ...]:
        return tuple(
            slice(int(o), int(o) + n) for o, n in zip(origin, self.patch_shape, strict=True)
        )

    def load(self, index: int) -> dict[str, Any]:
        item = int(self.items[index])
        if self.patch:
            region = self._region(self.patch_origins(np.array([index]))[0])
            volume = self.region(item, self.window, region)
        else:
            volume = np.array(self.array(item, self.window))
        out = {"image": torch.from_numpy(volume)[None], "item": item}
        if self.labels is not None:
            out["labels"] = torch.from_numpy(self.labels[item])
        return out

    def __getitems__(self, indices: list[int]) -> Sequence[dict[str, Any]]:
        """A batch of samples, read at once: each patch is copied once, from the shared
        cache into its row of one batch tensor (in a worker whose collate is
        :func:`collate_batch`, a tensor in shared memory, so handing it to the main process
        copies nothing more).  Batched, they equal ``[self[i] for i in indices]``."""
        if not self.patch:
            return [self[i] for i in indices]
        batch = self.guarded(int(indices[0]), lambda: self._read_batch(indices))
        samples = BatchSamples(batch, len(indices))
        if not self.per_sample:
            return samples
        return [
            self.guarded(int(i), lambda i=i, s=s: self.finish(int(i), s))
            for i, s in zip(indices, samples, strict=True)
        ]

    def _read_batch(self, indices: list[int]) -> dict[str, Any]:
        idx = np.asarray(indices, np.int64)
        items = self.items[idx].astype(np.int64)
        dtype = _TORCH_DTYPES[self.cache.groups[self.asset, self.window].dtype.str[1:]]
        shape = (len(idx), 1, *self.patch_shape)
        worker = get_worker_info() is not None
        ring = slot = None
        if worker and self.batch_ring and not self.per_sample:  # slots the feed frees
            ring = self._ring
            if ring is None or not ring.fits(shape, dtype):
                ring = self._ring = BatchRing(self.batch_ring, shape, dtype)
            slot = ring.take()
        if slot is not None:
            image, release = ring.batch(slot)
        else:
            image = torch.empty(shape, dtype=dtype)
            if worker and self.shared_batches:  # built straight into what goes to the main
                image.share_memory_()  # process (default_collate would copy it once more)
        out = image.numpy()
        size = self.patch_shape
        requests = [
            (self.asset, item, self.window,
             tuple(slice(o, o + n) for o, n in zip(origin, size, strict=True)), out[row, 0])
            for row, (item, origin) in enumerate(
                zip(items.tolist(), self.patch_origins(idx).tolist(), strict=True)
            )
        ]  # fmt: skip
        try:
            self.cache.read_into(requests, threads=copy_threads())
        except BaseException:
            if slot is not None:
                ring.give_back(slot)
            raise
        batch: dict[str, Any] = {"image": image, "item": torch.from_numpy(items)}
        if self.labels is not None:
            batch["labels"] = torch.from_numpy(self.labels[items])
        if slot is not None:
            batch[RELEASE] = release
        return batch

    # the device tier (DeviceCuttable) -----------------------------------------------------
    def device_refusal(self) -> str | None:
        if not self.patch:
            return "it yields whole volumes (patch=False), whose shapes differ"
        return super().device_refusal()

    def device_specs(self) -> dict[str, BoxSpec]:
        return {"image": BoxSpec(self.asset, self.window, self.patch_shape)}

    def device_cuts(self, indices: np.ndarray) -> DeviceCuts:
        """Each sample's patch where its patch sampler places it this epoch; its labels."""
        items = self.items[indices].astype(np.int64)
        extras = {"item": items}
        if self.labels is not None:
            extras["labels"] = self.labels[items]
        return DeviceCuts({"image": Boxes(items, self.patch_origins(indices))}, extras)

    def device_finish(
        self, cut: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        return {"image": cut["image"][:, None], **extras}

    def sample_units(self, indices: np.ndarray) -> np.ndarray:
        if not self.patch or self.patch_sampler.whole_volume:
            return super().sample_units(indices)
        return self.cache.units.region_units(
            self.asset,
            self.window,
            self.items[indices].astype(np.int64),
            self.origins[indices].astype(np.int64),
            self.patch_shape,
        )

    def partition_bytes(self) -> np.ndarray:
        """At most the whole volume, at most the units its patches can overlap."""
        whole = super().partition_bytes()
        if not self.patch or self.patch_sampler.whole_volume:
            return whole
        per_patch = units_per_box(self.cache.groups[self.asset, self.window], self.patch_shape)
        counts = np.bincount(self.items, minlength=len(self.keys)).astype(np.int64)
        return np.minimum(whole, counts * per_patch * self.cache.unit_bytes)


def collate_points(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Variable-size point sets → one (ΣN, 4) tensor of (batch index, z, y, x) and counts."""
    coords = [b["coords"] for b in batch]
    index = torch.cat([torch.full((len(c), 1), i, dtype=torch.int32) for i, c in enumerate(coords)])
    return {
        "coords": torch.cat([index, torch.cat(coords)], dim=1),
        "counts": torch.tensor([len(c) for c in coords]),
        "item": torch.tensor([b["item"] for b in batch]),
    }


class SparsePointsDataset(StoreDataset):
    """Occupied-voxel coordinates of one window per scan, ``min_points``…``max_points`` each.

    Scans with fewer than ``min_points`` points are left out when the dataset is built (from
    the manifest's shapes, without reading them).  Point sets differ in size, which
    ``default_collate`` cannot stack: batch them with :func:`collate_points` (``ds.collate``,
    what ``make_loader`` and the trainer use).
    """

    dataset, asset = CT.name, CT_SPARSE.path
    collate = staticmethod(collate_points)

    def __init__(
        self,
        store: str | ZarrStore,
        window: str = "lung",
        min_points: int = 16,
        max_points: int = 4096,
        cache_gb: float = 0.5,
        seed: int = 0,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        dataset_version: str | None = None,
    ) -> None:
        super().__init__(store, cache_gb, seed, transform, dataset_version)
        self.window, self.min_points, self.max_points = window, min_points, max_points
        counts = np.array([p["arrays"][window]["shape"][0] for p in self.partitions])
        self.items = np.flatnonzero(counts >= min_points).astype(np.uint32)
        if not len(self.items):
            raise StoreError(f"no scan of {self.url} has {min_points} points in window {window!r}")

    def cached_names(self) -> list[str]:
        return [self.window]

    def __len__(self) -> int:
        return len(self.items)

    def _seed(self, index: int) -> int:
        """The seed that picks sample ``index``'s points this epoch."""
        return int(self.rng(index).integers(2**31))

    def load(self, index: int) -> dict[str, Any]:
        item = int(self.items[index])
        coords = self.array(item, self.window)
        picked = sample_points(coords, self.min_points, self.max_points, seed=self._seed(index))
        return {"coords": torch.from_numpy(picked.astype(np.int32)), "item": item}

    # the device tier (DeviceCuttable): each point a box of one row -------------------------
    def device_specs(self) -> dict[str, BoxSpec]:
        dims = self.shape_of(0, self.window)[1:]
        return {"coords": BoxSpec(self.asset, self.window, (1, *dims), self.max_points)}

    def device_cuts(self, indices: np.ndarray) -> DeviceCuts:
        """The rows :meth:`load` picks of each sample this epoch, one box each, with the
        batch row and the count of each sample (what :func:`collate_points` adds)."""
        items = self.items[indices].astype(np.int64)
        rows = [
            sample_rows(self.shape_of(int(item), self.window)[0], self.min_points,
                        self.max_points, self._seed(int(i)))
            for i, item in zip(indices, items, strict=True)
        ]  # fmt: skip
        counts = np.array([len(r) for r in rows], np.int64)
        origins = np.zeros((int(counts.sum()), len(self.shape_of(0, self.window))), np.int64)
        origins[:, 0] = np.concatenate(rows) if rows else []
        extras = {
            "row": np.repeat(np.arange(len(rows)), counts).astype(np.int32),
            "counts": counts,
            "item": items,
        }
        return DeviceCuts({"coords": Boxes(np.repeat(items, counts), origins)}, extras)

    def device_finish(
        self, cut: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        points = cut["coords"].flatten(1).to(torch.int32)
        return {
            "coords": torch.cat([extras["row"][:, None], points], dim=1),
            "counts": extras["counts"],
            "item": extras["item"],
        }
