"""torch Datasets over the committed Zarr stores, with the shared decoded-array cache.

Every index is a handful of flat numpy arrays built from the dataset manifests and the
consolidated tables that the ``datasets`` assets write (no per-sample Python objects, which
workers would copy on read).  Stores open lazily in each process, so datasets pickle to
spawned workers and survive fork after the parent has read the store.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate, get_worker_info

from zarrfeed.errors import StoreError
from zarrfeed.formats import read_dat
from zarrfeed.store import ZarrStore, read_array, read_into
from zarrfeed.training.cache import Fill, SharedArrayCache
from zarrfeed.transforms import spike as sp
from zarrfeed.transforms.defects import random_defects, render_defects
from zarrfeed.transforms.sparse import sample_points

GB = 1 << 30


_TORCH_DTYPES = {"f2": torch.float16, "f4": torch.float32, "u1": torch.uint8, "i2": torch.int16}


def collate_batch(batch: Any) -> Any:
    """Collate for datasets whose ``__getitems__`` already returns a collated batch."""
    return batch if isinstance(batch, dict) else default_collate(batch)


class StoreDataset(Dataset):
    """Lazily opened store + shared cache; subclasses define the index and ``__getitem__``."""

    dataset: str = ""
    asset: str = ""  # the asset whose arrays are cached

    def __init__(self, store: str | ZarrStore, cache_gb: float = 2.0, seed: int = 0) -> None:
        self.url = store.url if isinstance(store, ZarrStore) else str(store)
        self.seed = seed
        # Shared with the workers (persistent ones too): set_epoch reaches them.
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.cache = SharedArrayCache(f"{self.url}|{self.asset}", int(cache_gb * GB))
        self._store: ZarrStore | None = None
        self._pid = os.getpid()
        manifest = self.store.read_manifest(self.dataset)
        self.keys: list[str] = manifest["keys"]
        if not self.keys:
            raise StoreError(
                f"no committed partitions of {self.dataset!r} ({', '.join(manifest['assets'])}) "
                f"in {self.url}: materialise the {self.dataset}_dataset asset first"
            )
        self.partitions = manifest["assets"][self.asset]["partitions"]

    @property
    def store(self) -> ZarrStore:
        if self._store is None or self._pid != os.getpid():
            self._store, self._pid = ZarrStore(self.url), os.getpid()
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "_handles": {}}

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Random crops and defects depend on (seed, epoch, index): reproducible per epoch.

        The epoch lives in shared memory, so persistent workers see the change; call it
        before iterating the loader for that epoch.
        """
        self._epoch[0] = epoch

    def rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, index])

    def shape_of(self, item: int, name: str) -> tuple[int, ...]:
        return tuple(self.partitions[item]["arrays"][name]["shape"])

    def array(self, item: int, name: str) -> np.ndarray:
        """The decoded array ``name`` of partition ``item``, from the shared cache."""
        return self.cache.get(f"{self.keys[item]}/{name}", self._fill(item, name))

    def region(self, item: int, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``array(item, name)[index]``; while another process is decoding that array into
        the cache, only the region is read from the store instead of waiting for it."""
        key = self.keys[item]
        full = self.cache.get(f"{key}/{name}", self._fill(item, name), wait=False)
        if full is not None:
            return full[index]
        handles = self.__dict__.setdefault("_handles", {})
        if (key, name) not in handles:
            handles[key, name] = self.store.open_array(self.asset, key, name)
        return handles[key, name][index]

    def _fill(self, item: int, name: str) -> Fill:
        """How to decode ``name`` of partition ``item`` straight into a cache entry, after
        checking the stored array against the manifest the index was built from."""
        key, want = self.keys[item], self.partitions[item]["arrays"][name]

        def into(out: np.ndarray) -> np.ndarray:
            data = self.store.open_array(self.asset, key, name)
            if list(data.shape) != want["shape"] or str(data.dtype) != want["dtype"]:
                raise StoreError(
                    f"partition {self.asset}/{key} array {name!r} is {data.dtype} {data.shape}; "
                    f"the manifest says {want['dtype']} {tuple(want['shape'])}: "
                    "rebuild the manifest"
                )
            return read_into(data, out)

        return Fill(tuple(want["shape"]), np.dtype(want["dtype"]), into)

    def cached_names(self) -> list[str]:
        return sorted(self.partitions[0]["arrays"])

    def nbytes(self) -> int:
        """Decoded bytes of every cached array: what preloading would take."""
        return sum(
            int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize
            for p in self.partitions
            for n, a in p["arrays"].items()
            if n in self.cached_names()
        )

    def preload(self) -> None:
        """Decode every cached array into the shared cache (seed 000's auto-preload).

        In this process: :func:`~zarrfeed.store.chunkio.read_into` decodes each array's chunks
        on every usable core straight into its cache file, faster than child processes start
        (a forkserver child re-imports ``__main__``, torch usually: 2.2 s; a plain fork can
        inherit a lock held by one of zarr's, Dagster's or torch's threads — one hung in CI).
        The cache is shared, so what is decoded here is what every worker then maps.
        """
        for item in range(len(self.keys)):
            for name in self.cached_names():
                self.array(item, name)

    def guarded(self, index: int, fn: Callable[[], dict]) -> dict:
        """Run ``fn``, naming the partition being read when it fails (in a worker too)."""
        try:
            return fn()
        except Exception as exc:
            raise RuntimeError(
                f"{type(self).__name__}[{index}] failed reading {self.asset} of {self.url}: {exc}"
            ) from exc


class CTPatchDataset(StoreDataset):
    """Windowed CT patches through the consolidated patch index, or whole volumes.

    Batches come collated from the workers (``__getitems__``): pass ``collate_batch`` as the
    DataLoader's ``collate_fn`` (``make_loader`` does it).

    ``patch=None`` yields whole volumes; otherwise each item is one entry of the patch
    index built by ``ct_patches`` (mostly-body patches).  CT-RATE labels come along as
    float32 0/1 (NaN where a scan has no label row).
    """

    dataset, asset = "ct", "ct/windows"
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
            raise StoreError(f"no window {window!r} in {self.asset}: {self.cached_names()}")
        self.labels, self.label_names = self._labels()
        if patch:
            table = self.store.open_partition("datasets/ct", "patches")
            offsets = table["offsets"][...]
            self.items = np.repeat(np.arange(len(self.keys), dtype=np.uint32), np.diff(offsets))
            self.origins = table["origins"][...]
            record = self.store.commit_record("ct/patches", self.keys[0])["attrs"]
            self.patch_shape = tuple(record["patch_shape"])

    def cached_names(self) -> list[str]:
        return [self.window]

    def _labels(self) -> tuple[np.ndarray | None, list[str]]:
        if not self.store.has_partition("datasets/ct", "labels"):
            return None, []
        group = self.store.open_partition("datasets/ct", "labels")
        table = group["labels"][...].astype(np.float32)
        table[table == group.attrs["unknown"]] = np.nan
        return table, list(group.attrs["names"])

    def __len__(self) -> int:
        return len(self.items) if self.patch else len(self.keys)

    def __getitem__(self, index: int) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            item = int(self.items[index]) if self.patch else index
            if self.patch:
                z, y, x = (int(o) for o in self.origins[index])
                d, h, w = self.patch_shape
                region = (slice(z, z + d), slice(y, y + h), slice(x, x + w))
                volume = self.region(item, self.window, region)
            else:
                volume = self.array(item, self.window)
            out = {"image": torch.from_numpy(np.array(volume))[None], "item": item}
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
            first = self.array(int(items[0]), self.window)
            image = torch.empty(
                (len(idx), 1, *self.patch_shape), dtype=_TORCH_DTYPES[first.dtype.str[1:]]
            )
            if get_worker_info() is not None:  # built straight into what is sent to the main
                image.share_memory_()  # process; in the main process itself, plain memory
            out = image.numpy()
            d, h, w = self.patch_shape
            for row, (i, item) in enumerate(zip(idx, items, strict=True)):
                z, y, x = (int(o) for o in self.origins[i])
                region = (slice(z, z + d), slice(y, y + h), slice(x, x + w))
                out[row, 0] = self.region(int(item), self.window, region)
            batch = {"image": image, "item": torch.from_numpy(items)}
            if self.labels is not None:
                batch["labels"] = torch.from_numpy(self.labels[items])
            return batch

        return self.guarded(int(indices[0]), load)


class SparsePointsDataset(StoreDataset):
    """Occupied-voxel coordinates of one window per scan, ``min_points``…``max_points`` each.

    Scans with fewer than ``min_points`` points are left out when the dataset is built (from
    the manifest's shapes, without reading them).  Use :func:`collate_points` for batches.
    """

    dataset, asset = "ct", "ct/sparse"

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


class SpikeClipDataset(StoreDataset):
    """Seed 001's clips: ``clip_len`` consecutive samples of blur, sharp and spike voxels,
    randomly cropped to ``crop`` (H, W).

    ``voxels="stored"`` reads the ``spike_voxels`` asset; ``"realtime"`` decodes the raw
    ``.dat`` files named in its provenance and bins them on the fly — the same tensors with
    no voxel store on disk.
    """

    dataset, asset = "spike", "spike/frames"

    def __init__(
        self,
        store: str | ZarrStore,
        clip_len: int = 3,
        crop: tuple[int, int] = (64, 64),
        voxels: str = "stored",
        cache_gb: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__(store, cache_gb, seed)
        if voxels not in ("stored", "realtime"):
            raise ValueError(f"voxels must be 'stored' or 'realtime', got {voxels!r}")
        self.clip_len, self.crop, self.voxel_mode = clip_len, tuple(crop), voxels
        samples = np.array([p["arrays"]["blur"]["shape"][0] for p in self.partitions])
        clips = np.maximum(samples - clip_len + 1, 0)
        self.items = np.repeat(np.arange(len(self.keys), dtype=np.uint32), clips)
        self.starts = (
            np.arange(len(self.items)) - np.repeat(np.cumsum(clips) - clips, clips)
        ).astype(np.uint32)
        manifest = self.store.read_manifest("spike")["assets"]["spike/voxels"]["partitions"]
        self.voxel_shapes = [tuple(p["arrays"]["voxels"]["shape"]) for p in manifest]
        if voxels == "realtime":
            self.sources = [self.store.commit_record("spike/voxels", k)["attrs"] for k in self.keys]

    def __len__(self) -> int:
        return len(self.items)

    def _voxels(self, item: int, start: int) -> np.ndarray:
        if self.voxel_mode == "stored":
            key = self.keys[item]
            full = self.cache.get(
                f"{key}/voxels",
                lambda: read_array(self.store.open_array("spike/voxels", key, "voxels")),
            )
            return full[start : start + self.clip_len]
        attrs = self.sources[item]
        p = attrs["params"]
        _, bins, h, w = self.voxel_shapes[item]
        folder = Path(attrs["source"]) / ("spike_packed" if p["layout"] == "packed" else "spike")
        return np.stack(
            [
                sp.voxel_bins(
                    read_dat(folder / f"{stem}.dat", h, w, p["layout"], p["frames"]), bins
                )
                for stem in p["samples"][start : start + self.clip_len]
            ]
        )

    def __getitem__(self, index: int) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            item, start = int(self.items[index]), int(self.starts[index])
            blur, sharp = self.array(item, "blur"), self.array(item, "sharp")
            h, w = blur.shape[1:3]
            ch, cw = min(self.crop[0], h), min(self.crop[1], w)
            rng = self.rng(index)
            y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
            clip = slice(start, start + self.clip_len)

            def frames(a: np.ndarray) -> torch.Tensor:  # (L, H, W, 3) uint8 → (L, 3, h, w)
                return torch.from_numpy(
                    np.ascontiguousarray(a[clip, y : y + ch, x : x + cw].transpose(0, 3, 1, 2))
                )

            vox = self._voxels(item, start)[:, :, y : y + ch, x : x + cw]
            voxels = torch.from_numpy(np.ascontiguousarray(vox))
            return {"blur": frames(blur), "sharp": frames(sharp), "voxels": voxels, "item": item}

        return self.guarded(index, load)


class ImagePatchDataset(StoreDataset):
    """Seed 002's inspection patches: crop first through the patch index, then process;
    optional local Gaussian defects on channel 0 with their ground-truth mask."""

    dataset, asset = "image", "images/images"

    def __init__(
        self, store: str | ZarrStore, defects: bool = True, cache_gb: float = 1.0, seed: int = 0
    ) -> None:
        super().__init__(store, cache_gb, seed)
        self.defects = defects
        table = self.store.open_partition("datasets/image", "patches")
        offsets = table["offsets"][...]
        self.sets = np.repeat(np.arange(len(self.keys), dtype=np.uint32), np.diff(offsets))
        self.images, self.origins = table["items"][...], table["origins"][...]
        attrs = self.store.commit_record("images/patches", self.keys[0])["attrs"]
        self.patch_shape = tuple(attrs["patch_shape"])

    def __len__(self) -> int:
        return len(self.sets)

    def __getitem__(self, index: int) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            item = int(self.sets[index])
            (y, x), (h, w) = (int(o) for o in self.origins[index]), self.patch_shape
            crop = self.array(item, "images")[int(self.images[index]), y : y + h, x : x + w]
            patch = crop.astype(np.float32) / np.float32(np.iinfo(crop.dtype).max)
            mask = np.zeros((h, w), dtype=np.uint8)
            if self.defects:
                found = random_defects((h, w), self.rng(index))
                patch[..., 0], mask = render_defects(patch[..., 0], found)
            return {
                "image": torch.from_numpy(np.ascontiguousarray(patch.transpose(2, 0, 1))),
                "mask": torch.from_numpy(mask)[None],
                "item": item,
            }

        return self.guarded(index, load)
