"""Inspection-image patches with synthesised local defects."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from zarrfeed.families.images.family import IMAGE_PATCHES, IMAGE_STORE, IMAGES, PATCH_TABLE
from zarrfeed.store import ZarrStore
from zarrfeed.training.augment import Augment, AugmentConfig
from zarrfeed.training.data.base import StoreDataset
from zarrfeed.training.data.protocols import Boxes, BoxSpec, DeviceCuts
from zarrfeed.transforms.defects import defect_table, random_defects, render_defects


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

    def _scale(self) -> np.float32:
        """What divides the stored integers into [0, 1]."""
        return np.float32(np.iinfo(self.cache.groups[self.asset, "images"].dtype).max)

    def load(self, index: int) -> dict[str, Any]:
        item, image = int(self.sets[index]), int(self.images[index])
        (y, x), (h, w) = (int(o) for o in self.origins[index]), self.patch_shape
        region = (slice(image, image + 1), slice(y, y + h), slice(x, x + w), slice(None))
        crop = self.region(item, "images", region)[0]
        patch = crop.astype(np.float32) / self._scale()
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

    # the device tier (DeviceCuttable): the crop and the defects rendered on the device ------
    def device_refusal(self) -> str | None:
        channels = {tuple(p["arrays"]["images"]["shape"][3:]) for p in self.partitions}
        if len(channels) > 1:
            return f"its images have different channels ({sorted(channels)}): no common box"
        return super().device_refusal()

    def device_specs(self) -> dict[str, BoxSpec]:
        h, w = self.patch_shape
        return {"image": BoxSpec(self.asset, "images", (1, h, w, *self.shape_of(0, "images")[3:]))}

    def device_cuts(self, indices: np.ndarray) -> DeviceCuts:
        """Each sample's crop as the patch index places it; its defects drawn from the
        sample's generator this epoch, as :meth:`load` draws them (parameters only: the
        rendering is the device's)."""
        items = self.sets[indices].astype(np.int64)
        origins = np.zeros((len(indices), 4), np.int64)
        origins[:, 0], origins[:, 1:3] = self.images[indices], self.origins[indices]
        extras = {"item": items}
        if self.defects:
            shape = tuple(self.patch_shape)
            extras |= defect_table([random_defects(shape, self.rng(int(i))) for i in indices])
        return DeviceCuts({"image": Boxes(items, origins)}, extras)

    def device_finish(
        self, cut: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        crop = cut["image"][:, 0]  # (B, h, w, C) of the stored integers
        image = (crop.to(torch.float32) / float(self._scale())).permute(0, 3, 1, 2).contiguous()
        if self.defects:
            image, mask = render_batch(image, extras)
        else:
            mask = torch.zeros((len(image), 1, *image.shape[2:]), dtype=torch.uint8,
                               device=image.device)  # fmt: skip
        return {"image": image, "mask": mask, "item": extras["item"]}


def render_batch(
    image: torch.Tensor, table: dict[str, torch.Tensor], mask_level: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """``render_defects`` (:mod:`zarrfeed.transforms.defects`) for a whole batch on
    ``image``'s device: ``image`` (B, C, h, w) float32 gets every defect of ``table`` (from
    ``defect_table``) on channel 0 and those outside the mask on the other channels, in
    place, by one scatter-add; returns it and the (B, 1, h, w) uint8 mask.  No boolean
    indexing, so the host never waits for the device: a kernel element outside its defect
    or the patch adds 0 to a pixel inside.  Where defects overlap, the sums may round in
    another order than the host's (within float32 rounding)."""
    b, c, h, w = image.shape
    kernels, sizes = table["defect_kernels"], table["defect_sizes"]
    if not len(kernels):
        return image, torch.zeros((b, 1, h, w), dtype=torch.uint8, device=image.device)
    high, wide = kernels.shape[1:]
    i = torch.arange(high, device=image.device)[None, :, None]
    j = torch.arange(wide, device=image.device)[None, None, :]
    centers = table["defect_centers"]
    y = (centers[:, 0] - sizes[:, 0] // 2)[:, None, None] + i
    x = (centers[:, 1] - sizes[:, 1] // 2)[:, None, None] + j
    inside = (i < sizes[:, 0, None, None]) & (j < sizes[:, 1, None, None])
    inside &= (y >= 0) & (y < h) & (x >= 0) & (x < w)
    rows = table["defect_rows"][:, None, None]
    plane = y.clamp(0, h - 1) * w + x.clamp(0, w - 1)  # outside: added as 0, so any pixel
    in_mask = table["defect_in_mask"][:, None, None]
    value = table["defect_amplitudes"][:, None, None] * kernels
    channel = torch.arange(c, device=image.device)[None, :, None, None]
    drawn = inside[:, None] & ((channel == 0) | ~in_mask[:, None])  # (n, C, high, wide)
    where = (rows[:, None] * c + channel) * (h * w) + plane[:, None]
    added = torch.where(drawn, value[:, None], torch.zeros((), device=image.device))
    image.view(-1).index_put_((where.reshape(-1),), added.reshape(-1), accumulate=True)
    marked = (inside & in_mask & (kernels >= mask_level)).to(torch.int32)
    hits = torch.zeros(b * h * w, dtype=torch.int32, device=image.device)
    hits.index_put_(((rows * (h * w) + plane).reshape(-1),), marked.reshape(-1), accumulate=True)
    return image, (hits > 0).to(torch.uint8).view(b, 1, h, w)
