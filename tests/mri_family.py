"""A family that exists only here: small MRI-like 3-D volumes kept as ``.npy`` files in a
raw folder's ``mri/``.

This one file is its whole declaration — its reader, its transform, its stored stages with
their checks, its dataset, its training reader and its training task with its own config
section — and nothing in zarrfeed names it: ``tests/test_new_family.py`` shows zarrfeed
discovering, building, checking, rebuilding, listing, reading and training it from this
declaration alone (``ZARRFEED_FAMILIES=mri_family:MRI`` registers its task).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional as F

from zarrfeed.errors import InputError
from zarrfeed.families import Family, Inputs, RawSource, Reader, Stage, Step
from zarrfeed.formats import Tree
from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import Scan, raw_origin
from zarrfeed.store.contract import ArraySpec, Check, StoredAsset
from zarrfeed.store.keys import sanitise_key
from zarrfeed.training.config import DataSection
from zarrfeed.training.data.base import StoreDataset
from zarrfeed.training.tasks import Batch, Task

FOLDER = "mri"  # where its raw items are, under the raw folder
ZYX = ("z", "y", "x")


class MRISettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    clip_percentile: float = Field(99.0, description="intensity mapped to 1 (percentile)")
    foreground: float = Field(0.2, description="normalised intensity above which is tissue")


# -- reader and transform --------------------------------------------------------------------


def scan_mri(root: str, tree: Tree) -> Scan:
    """Key → catalog entry of every ``mri/*.npy`` of the walk of ``root`` (nothing is
    read)."""
    origin, found = raw_origin(root), Scan()
    found.skipped = {}
    for name in tree.get(Path(root, FOLDER), []):
        if not name.endswith(".npy"):
            continue
        path = Path(root, FOLDER, name)
        st = os.stat(path)
        key = sanitise_key(path.stem)
        found[key] = RawItem(key, "mri", str(path), origin, st.st_size, st.st_mtime)
    return found


def read_mri(path: Path) -> np.ndarray:
    volume = np.load(path, mmap_mode="r")
    if volume.ndim != 3:
        raise InputError(path, "a 3-D volume", f"{volume.ndim} dimensions {volume.shape}")
    return np.asarray(volume, dtype=np.float32)


def normalise(volume: np.ndarray, percentile: float) -> np.ndarray:
    """Intensities divided by their ``percentile``, clipped to [0, 1], as float16."""
    top = float(np.percentile(volume, percentile))
    return np.clip(volume / top, 0, 1).astype(np.float16) if top > 0 else volume.astype(np.float16)


# -- stages ------------------------------------------------------------------------------------

MRI_VOLUME = StoredAsset(
    name="mri_volume",
    path="mri/volume",
    family="mri",
    version="1",
    arrays=(ArraySpec("volume", ZYX, "float16"),),
    description="float16 MRI volume, intensities normalised to [0, 1].",
    params=("clip_percentile",),
    checks=(Check("in_unit_range", "Every voxel is finite and inside [0, 1]."),),
)
MRI_MASK = StoredAsset(
    name="mri_mask",
    path="mri/mask",
    family="mri",
    version="1",
    arrays=(ArraySpec("mask", ZYX, "uint8"),),
    description="uint8 tissue mask of the normalised volume.",
    params=("foreground",),
    inputs=(MRI_VOLUME.name,),
    checks=(Check("has_tissue", "At least one voxel is tissue."),),
)


def volume_step(inputs: Inputs, key: str) -> Step:
    item, sha, identity = inputs.source(key)
    percentile = inputs.settings["clip_percentile"]

    def check(arrays: dict[str, np.ndarray]) -> dict[str, tuple[bool, dict[str, Any]]]:
        v = arrays["volume"].astype(np.float32)
        ok = bool(np.isfinite(v).all() and v.min() >= 0 and v.max() <= 1)
        return {"in_unit_range": (ok, {"finite": bool(np.isfinite(v).all())})}

    return Step(
        inputs=identity,
        source=item.location,
        source_sha256=sha,
        produce=lambda: {"volume": normalise(read_mri(inputs.local(item)), percentile)},
        check=check,
        describe=lambda arrays: {"shape": "×".join(map(str, arrays["volume"].shape))},
        attrs={"source_stamp": item.stamp},
        watch=inputs.watch(item),
    )


def mask_step(inputs: Inputs, key: str) -> Step:
    threshold = inputs.settings["foreground"]

    def produce() -> dict[str, np.ndarray]:
        volume = inputs.read(MRI_VOLUME, key, "volume")
        return {"mask": (volume > threshold).astype(np.uint8)}

    return Step(
        inputs=inputs.upstream(key, MRI_VOLUME),
        source=inputs.store.partition_url(MRI_VOLUME.path, key),
        source_sha256=None,
        produce=produce,
        check=lambda a: {"has_tissue": (bool(a["mask"].any()), {"voxels": int(a["mask"].sum())})},
    )


def describe_raw(item: RawItem) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    shape = np.load(item.location, mmap_mode="r").shape
    return {"shape": str(shape)}, len(shape) == 3, {"shape": str(shape)}


MRI = Family(
    name="mri",
    partitions="mri_volumes",
    raw=RawSource(
        asset="mri_raw_volume",
        items="MRI volumes",
        description="A raw MRI volume (.npy): its content hash and shape.",
        kinds=frozenset({"numpy"}),
        scan=scan_mri,
        files=lambda item: [Path(item.location)],
        describe=describe_raw,
        readable=Check("readable", "The file holds a 3-D array."),
    ),
    settings=MRISettings,
    stages=(Stage(MRI_VOLUME, volume_step), Stage(MRI_MASK, mask_step)),
    readers=(Reader("mri-volumes", "mri_family:MRIVolumes"),),
    tasks=("mri_family:TissueSegmentation",),
)


# -- training reader ---------------------------------------------------------------------------


class MRIVolumes(StoreDataset):
    """Whole normalised volumes of the MRI dataset's manifest and their tissue masks, one
    sample each."""

    dataset, asset = MRI.name, MRI_VOLUME.path

    def __init__(
        self,
        store: Any,
        cache_gb: float = 0.1,
        seed: int = 0,
        dataset_version: str | None = None,
    ) -> None:
        super().__init__(store, cache_gb, seed, dataset_version=dataset_version)
        self.items = np.arange(len(self.keys), dtype=np.uint32)
        self.mask_partitions = self.manifest_assets[MRI_MASK.path]["partitions"]

    def sources(self) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
        return {**super().sources(), MRI_MASK.path: (self.mask_partitions, ["mask"])}

    def __len__(self) -> int:
        return len(self.items)

    def load(self, index: int) -> dict[str, Any]:
        volume = np.array(self.array(index, "volume"))
        mask = np.array(self.cache.array(MRI_MASK.path, index, "mask"))
        return {
            "image": torch.from_numpy(volume)[None],
            "mask": torch.from_numpy(mask)[None],
            "item": index,
        }


# -- training task -----------------------------------------------------------------------------


class TissueData(DataSection):
    """What tissue segmentation reads: whole volumes, or the first ``volumes`` of them."""

    volumes: int = Field(0, ge=0, description="volumes to train on (0: every one)")


class TissueSegmentation(Task):
    """Tissue segmentation: the stored tissue mask of each MRI volume from its voxels."""

    name, family, metric, label = "mri_tissue", MRI, "iou", "IoU"
    Data = TissueData

    def dataset(self, split: str | None = None) -> Any:
        d = self.config.data
        ds = MRIVolumes(self.config.store, d.cache_gb, self.config.seed, d.dataset_version)
        if d.volumes:
            ds.items = ds.items[: d.volumes]
        return ds

    def model(self, dataset: Any) -> nn.Module:
        w = self.config.train.width
        return nn.Sequential(nn.Conv3d(1, w, 3, padding=1), nn.ReLU(), nn.Conv3d(w, 1, 1))

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = model(batch["image"].float()).float()
        target = batch["mask"].float()
        loss = F.binary_cross_entropy_with_logits(logits, target)
        pred, truth = logits > 0, target > 0
        iou = (pred & truth).sum() / (pred | truth).sum().clamp(min=1)
        return loss, {"iou": iou}
