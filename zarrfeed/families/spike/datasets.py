"""Spike-camera clips: blurred and sharp frames with their spike voxels, stored or
binned in real time from the raw ``.dat`` files."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zarrfeed.families.spike.family import SPIKE, SPIKE_FRAMES, SPIKE_VOXELS
from zarrfeed.formats import read_dat
from zarrfeed.store import ZarrStore
from zarrfeed.training.augment import Augment, AugmentConfig
from zarrfeed.training.data.base import StoreDataset
from zarrfeed.training.data.protocols import Boxes, BoxSpec, DeviceCuts
from zarrfeed.transforms import spike as sp


class SpikeClipDataset(StoreDataset):
    """Deblurring clips: ``clip_len`` consecutive samples of blur, sharp and spike voxels,
    randomly cropped to ``crop`` (H, W).

    ``voxels="stored"`` reads the ``spike_voxels`` asset; ``"realtime"`` decodes the raw
    ``.dat`` files named in its provenance and bins them on the fly — the same tensors with
    no voxel store on disk.  Only the crop is read from the cache.
    """

    dataset, asset = SPIKE.name, SPIKE_FRAMES.path

    def __init__(
        self,
        store: str | ZarrStore,
        clip_len: int = 3,
        crop: tuple[int, int] = (64, 64),
        voxels: str = "stored",
        cache_gb: float = 1.0,
        seed: int = 0,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        dataset_version: str | None = None,
        augment: Augment | AugmentConfig | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(store, cache_gb, seed, transform, dataset_version, augment)
        if voxels not in ("stored", "realtime"):
            raise ValueError(f"voxels must be 'stored' or 'realtime', got {voxels!r}")
        self.clip_len, self.crop, self.voxel_mode = clip_len, tuple(crop), voxels
        samples = np.array([p["arrays"]["blur"]["shape"][0] for p in self.partitions])
        clips = np.maximum(samples - clip_len + 1, 0)
        self.items = np.repeat(np.arange(len(self.keys), dtype=np.uint32), clips)
        self.starts = (
            np.arange(len(self.items)) - np.repeat(np.cumsum(clips) - clips, clips)
        ).astype(np.uint32)
        self.voxel_partitions = self.manifest_assets[SPIKE_VOXELS.path]["partitions"]
        self.voxel_shapes = [tuple(p["arrays"]["voxels"]["shape"]) for p in self.voxel_partitions]
        if voxels == "realtime":
            self.sources_raw = self.pinned_attrs(SPIKE_VOXELS.path, range(len(self.keys)))

    def cached_names(self) -> list[str]:
        return ["blur", "sharp"]

    def sources(self) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
        found = super().sources()
        if self.voxel_mode == "stored":
            found[SPIKE_VOXELS.path] = (self.voxel_partitions, ["voxels"])
        return found

    def __len__(self) -> int:
        return len(self.items)

    def _voxels(self, item: int, start: int, y: slice, x: slice) -> np.ndarray:
        clip = slice(start, start + self.clip_len)
        if self.voxel_mode == "stored":
            return self.cache.read(SPIKE_VOXELS.path, item, "voxels", (clip, slice(None), y, x))
        p = self.sources_raw[item]  # the voxels' provenance: how the raw stream was binned
        _, bins, h, w = self.voxel_shapes[item]
        folder = Path(p["source"]) / p["spike_folder"]
        return np.stack(
            [
                sp.voxel_bins(
                    read_dat(folder / f"{stem}.dat", h, w, p["layout"], p["frames"]), bins
                )[:, y, x]
                for stem in p["samples"][clip]
            ]
        )

    def _placed(self, index: int) -> tuple[int, int, int, int, int, int]:
        """(item, first sample, y0, x0, crop height, crop width) of clip ``index`` this
        epoch: the crop placed by the clip's generator."""
        item, start = int(self.items[index]), int(self.starts[index])
        h, w = self.shape_of(item, "blur")[1:3]
        ch, cw = min(self.crop[0], h), min(self.crop[1], w)
        rng = self.rng(index)
        y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        return item, start, y0, x0, ch, cw

    def load(self, index: int) -> dict[str, Any]:
        item, start, y0, x0, ch, cw = self._placed(index)
        y, x = slice(y0, y0 + ch), slice(x0, x0 + cw)
        region = (slice(start, start + self.clip_len), y, x, slice(None))

        def frames(name: str) -> torch.Tensor:  # (L, h, w, 3) uint8 → (L, 3, h, w)
            crop = self.region(item, name, region)
            return torch.from_numpy(np.ascontiguousarray(crop.transpose(0, 3, 1, 2)))

        voxels = torch.from_numpy(np.ascontiguousarray(self._voxels(item, start, y, x)))
        return {
            "blur": frames("blur"),
            "sharp": frames("sharp"),
            "voxels": voxels,
            "item": item,
        }

    # the device tier (DeviceCuttable) -----------------------------------------------------
    def _crops(self) -> set[tuple[int, ...]]:
        """The (height, width, channels) of every recording's crops, and its voxel bins."""
        return {
            (min(self.crop[0], p["arrays"]["blur"]["shape"][1]),
             min(self.crop[1], p["arrays"]["blur"]["shape"][2]),
             *p["arrays"]["blur"]["shape"][3:], v[1])
            for p, v in zip(self.partitions, self.voxel_shapes, strict=True)
        }  # fmt: skip

    def device_refusal(self) -> str | None:
        if self.voxel_mode == "realtime":
            return (
                "its voxels are binned from the raw .dat files on the host for every clip "
                "(voxels='realtime'); voxels='stored' reads them from the cache"
            )
        if len(crops := self._crops()) > 1:
            return f"its recordings give clips of different shapes ({sorted(crops)})"
        return super().device_refusal()

    def device_specs(self) -> dict[str, BoxSpec]:
        (ch, cw, *channels, bins), n = next(iter(self._crops())), self.clip_len
        frames = (n, ch, cw, *channels)
        return {
            "blur": BoxSpec(self.asset, "blur", frames),
            "sharp": BoxSpec(self.asset, "sharp", frames),
            "voxels": BoxSpec(SPIKE_VOXELS.path, "voxels", (n, bins, ch, cw)),
        }

    def device_cuts(self, indices: np.ndarray) -> DeviceCuts:
        """Each clip's frames and voxels where :meth:`load` crops them this epoch."""
        placed = np.array([self._placed(int(i))[:4] for i in indices], np.int64).reshape(-1, 4)
        items, start, y0, x0 = placed.T
        zero = np.zeros_like(start)
        frames = Boxes(items, np.stack([start, y0, x0, zero], axis=1))
        voxels = Boxes(items, np.stack([start, zero, y0, x0], axis=1))
        boxes = {"blur": frames, "sharp": frames, "voxels": voxels}
        return DeviceCuts(boxes, {"item": items})

    def device_finish(
        self, cut: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        def frames(name: str) -> torch.Tensor:  # (B, L, h, w, 3) → (B, L, 3, h, w)
            return cut[name].permute(0, 1, 4, 2, 3).contiguous()

        return {
            "blur": frames("blur"),
            "sharp": frames("sharp"),
            "voxels": cut["voxels"],
            "item": extras["item"],
        }
