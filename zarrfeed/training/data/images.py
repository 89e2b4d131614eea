"""Inspection-image patches with synthesised local defects."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from zarrfeed.families.images import IMAGE_PATCHES, IMAGE_STORE, IMAGES, PATCH_TABLE
from zarrfeed.store import ZarrStore
from zarrfeed.training.augment import Augment, AugmentConfig
from zarrfeed.training.data.base import StoreDataset
from zarrfeed.transforms.defects import random_defects, render_defects


class ImagePatchDataset(StoreDataset):
    """Inspection patches: crop first through the patch index, then process; optional local
    Gaussian defects with their ground-truth mask.

    Channel 0 is the inspected image, channels 1 and 2 its references (the inspection
    images' layout): every defect is drawn on channel 0, and those outside the mask on the
    references too, so a defect is real exactly when the references lack it — what a model
    can learn, and what the mask marks."""

    dataset, asset = IMAGES.name, IMAGE_STORE.path

    def __init__(
        self,
        store: str | ZarrStore,
        defects: bool = True,
        cache_gb: float = 1.0,
        seed: int = 0,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        dataset_version: str | None = None,
        augment: Augment | AugmentConfig | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(store, cache_gb, seed, transform, dataset_version, augment)
        self.defects = defects
        table, _ = self.read_table(
            IMAGES.dataset_path, PATCH_TABLE.name, ["offsets", "items", "origins"]
        )
        offsets = table["offsets"]
        self.sets = np.repeat(np.arange(len(self.keys), dtype=np.uint32), np.diff(offsets))
        self.images, self.origins = table["items"], table["origins"]
        attrs = self.pinned_attrs(IMAGE_PATCHES.path, [0])[0]
        self.patch_shape = tuple(attrs["patch_shape"])

    def cached_names(self) -> list[str]:
        return ["images"]

    def sample_items(self) -> np.ndarray:
        return self.sets

    def __len__(self) -> int:
        return len(self.sets)

    def load(self, index: int) -> dict[str, Any]:
        item, image = int(self.sets[index]), int(self.images[index])
        (y, x), (h, w) = (int(o) for o in self.origins[index]), self.patch_shape
        region = (slice(image, image + 1), slice(y, y + h), slice(x, x + w), slice(None))
        crop = self.region(item, "images", region)[0]
        patch = crop.astype(np.float32) / np.float32(np.iinfo(crop.dtype).max)
        mask = np.zeros((h, w), dtype=np.uint8)
        if self.defects:
            found = random_defects((h, w), self.rng(index))
            patch[..., 0], mask = render_defects(patch[..., 0], found)
            decoys = found.select(~found.in_mask)
            for c in range(1, patch.shape[-1]):
                patch[..., c] = render_defects(patch[..., c], decoys)[0]
        return {
            "image": torch.from_numpy(np.ascontiguousarray(patch.transpose(2, 0, 1))),
            "mask": torch.from_numpy(mask)[None],
            "item": item,
        }
