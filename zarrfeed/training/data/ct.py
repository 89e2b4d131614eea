"""Windowed CT: patches through the consolidated patch index, or whole volumes; and the
occupied-voxel coordinates of the sparse indices."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from zarrfeed.errors import StoreError
from zarrfeed.store import ZarrStore
from zarrfeed.store.chunkio import usable_threads
from zarrfeed.store.contract import CT_DATASET, CT_PATCHES, CT_SPARSE, CT_WINDOWS
from zarrfeed.training.data.base import StoreDataset, collate_batch
from zarrfeed.transforms.sparse import sample_points

_TORCH_DTYPES = {"f2": torch.float16, "f4": torch.float32, "u1": torch.uint8, "i2": torch.int16}


class CTPatchDataset(StoreDataset):
    """Windowed CT patches through the consolidated patch index, or whole volumes.

    Batches come collated from the workers (``__getitems__``): pass ``collate_batch`` as the
    DataLoader's ``collate_fn`` (``make_loader`` does it).

    ``patch=None`` yields whole volumes; otherwise each item is one entry of the patch
    index built by ``ct_patches`` (mostly-body patches).  CT-RATE labels come along as
    float32 0/1 (NaN where a scan has no label row).
    """

    dataset, asset = CT_DATASET.name, CT_WINDOWS.path
    collate = staticmethod(collate_batch)

    def __init__(
        self,
        store: str | ZarrStore,
        window: str = "lung",
        patch: bool = True,
        cache_gb: float = 2.0,
        seed: int = 0,
    ) -> None:
        super().__init__(store, cache_gb, seed)
        self.window, self.patch = window, patch
        if window not in self.partitions[0]["arrays"]:
            have = ", ".join(sorted(self.partitions[0]["arrays"]))
            raise StoreError(
                f"no window {window!r} in {self.asset} of {self.url}: it has {have} (set "
                "data.window to one of them, or add the window to ct_settings.windows and "
                "rebuild)"
            )
        self.labels, self.label_names = self._labels()
        self.items = np.arange(len(self.keys), dtype=np.uint32)
        if patch:
            table = self.store.open_partition(CT_DATASET.path, "patches")
            offsets = table["offsets"][...]
            self.items = np.repeat(self.items, np.diff(offsets))
            self.origins = table["origins"][...]
            record = self.store.commit_record(CT_PATCHES.path, self.keys[0])["attrs"]
            self.patch_shape = tuple(record["patch_shape"])

    def cached_names(self) -> list[str]:
        return [self.window]

    def _labels(self) -> tuple[np.ndarray | None, list[str]]:
        if not self.store.has_partition(CT_DATASET.path, "labels"):
            return None, []
        group = self.store.open_partition(CT_DATASET.path, "labels")
        table = group["labels"][...].astype(np.float32)
        table[table == group.attrs["unknown"]] = np.nan
        return table, list(group.attrs["names"])

    def __len__(self) -> int:
        return len(self.items)

    def _patch_region(self, index: int) -> tuple[slice, ...]:
        return tuple(
            slice(int(o), int(o) + n)
            for o, n in zip(self.origins[index], self.patch_shape, strict=True)
        )

    def __getitem__(self, index: int) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            item = int(self.items[index])
            if self.patch:
                volume = self.region(item, self.window, self._patch_region(index))
            else:
                volume = np.array(self.array(item, self.window))
            out = {"image": torch.from_numpy(volume)[None], "item": item}
            if self.labels is not None:
                out["labels"] = torch.from_numpy(self.labels[item])
            return out

        return self.guarded(index, load)

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        """A whole batch of patches, collated in the worker (DataLoader's batched fetch).

        Each patch is copied once, from the shared cache straight into a batch tensor that
        lives in shared memory, so handing it to the main process copies nothing more.  The
        per-sample path copies three times (slice, collate, transfer).  Use with
        :func:`collate_batch` (``make_loader`` does).
        """
        if not self.patch:
            return default_collate([self[i] for i in indices])

        def load() -> dict[str, Any]:
            idx = np.asarray(indices)
            items = self.items[idx].astype(np.int64)
            dtype = self.cache.groups[self.asset, self.window].dtype
            image = torch.empty(
                (len(idx), 1, *self.patch_shape), dtype=_TORCH_DTYPES[dtype.str[1:]]
            )
            worker = get_worker_info() is not None
            if worker:  # built straight into what is sent to the main process
                image.share_memory_()  # (in the main process itself, plain memory)
            out = image.numpy()
            requests = [
                (self.asset, int(item), self.window, self._patch_region(int(i)), out[row, 0])
                for row, (i, item) in enumerate(zip(idx, items, strict=True))
            ]
            # In the training process copies run on every usable core (they release the GIL);
            # a worker is one of several processes sharing the cores.
            self.cache.read_into(requests, threads=1 if worker else usable_threads())
            batch = {"image": image, "item": torch.from_numpy(items)}
            if self.labels is not None:
                batch["labels"] = torch.from_numpy(self.labels[items])
            return batch

        return self.guarded(int(indices[0]), load)

    def sample_units(self, indices: np.ndarray) -> np.ndarray:
        if not self.patch:
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
        if not self.patch:
            return whole
        group = self.cache.groups[self.asset, self.window]
        per_patch = max(  # units a patch overlaps at most: (p + u - 2) // u + 1 per axis
            int(
                np.prod([(p + u - 2) // u + 1 for p, u in zip(self.patch_shape, unit, strict=True)])
            )
            for unit in {tuple(u) for u in group.units.tolist()}
        )
        counts = np.bincount(self.items, minlength=len(self.keys)).astype(np.int64)
        return np.minimum(whole, counts * per_patch * self.cache.unit_bytes)


class SparsePointsDataset(StoreDataset):
    """Occupied-voxel coordinates of one window per scan, ``min_points``…``max_points`` each.

    Scans with fewer than ``min_points`` points are left out when the dataset is built (from
    the manifest's shapes, without reading them).  Use :func:`collate_points` for batches.
    """

    dataset, asset = CT_DATASET.name, CT_SPARSE.path

    def __init__(
        self,
        store: str | ZarrStore,
        window: str = "lung",
        min_points: int = 16,
        max_points: int = 4096,
        cache_gb: float = 0.5,
        seed: int = 0,
    ) -> None:
        super().__init__(store, cache_gb, seed)
        self.window, self.min_points, self.max_points = window, min_points, max_points
        counts = np.array([p["arrays"][window]["shape"][0] for p in self.partitions])
        self.items = np.flatnonzero(counts >= min_points).astype(np.uint32)
        if not len(self.items):
            raise StoreError(f"no scan of {self.url} has {min_points} points in window {window!r}")

    def cached_names(self) -> list[str]:
        return [self.window]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            item = int(self.items[index])
            coords = self.array(item, self.window)
            picked = sample_points(
                coords, self.min_points, self.max_points, seed=int(self.rng(index).integers(2**31))
            )
            return {"coords": torch.from_numpy(picked.astype(np.int32)), "item": item}

        return self.guarded(index, load)


def collate_points(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Variable-size point sets → one (ΣN, 4) tensor of (batch index, z, y, x) and counts."""
    coords = [b["coords"] for b in batch]
    index = torch.cat([torch.full((len(c), 1), i, dtype=torch.int32) for i, c in enumerate(coords)])
    return {
        "coords": torch.cat([index, torch.cat(coords)], dim=1),
        "counts": torch.tensor([len(c) for c in coords]),
        "item": torch.tensor([b["item"] for b in batch]),
    }
