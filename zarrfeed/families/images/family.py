"""The image family: a raw folder of images → an image store → a patch index.

Training crops patches first and processes them after, so the index of useful patch origins
is built once here rather than by rejection at load time; the dataset carries it as one
table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from zarrfeed.errors import InputError
from zarrfeed.families.facts import Picture
from zarrfeed.families.family import Family, RawSource, Reader, Stage, Table
from zarrfeed.families.images.discover import item_files, scan_images
from zarrfeed.families.stages import Checks, Inputs, Step
from zarrfeed.formats import read_image
from zarrfeed.formats.images import image_orientation
from zarrfeed.formats.limits import GIB, Bound, claimed_bytes, require_allocatable
from zarrfeed.formats.previews import image_png
from zarrfeed.sources.catalog import RawItem
from zarrfeed.store.contract import ArraySpec, Check, StoredAsset
from zarrfeed.transforms.augment.ops import Affine, Blur, Flip, Gamma, Intensity, Noise, Rot90
from zarrfeed.transforms.patches import PatchGrid, patch_fractions
from zarrfeed.transforms.spike import to_gray

# A 16k×16k RGB image is 768 MB; 4 GiB holds ~340 2k×2k RGB images.
BOUND = Bound("images", 4 * GIB)  # the most one set's images may take


class ImageSettings(BaseModel):
    """The image patch grid and its foreground filter."""

    model_config = ConfigDict(extra="forbid")

    patch_yx: list[int] = [128, 128]
    stride_yx: list[int] = [64, 64]
    foreground: float = Field(0.02, description="grey level (0–1) above which is foreground")
    min_foreground_fraction: float = 0.5


IMAGE_STORE = StoredAsset(
    name="image_store",
    path="images/images",
    family="images",
    version="2",  # 2: 16-bit colour kept, EXIF orientation applied
    arrays=(ArraySpec("images", ("image", "y", "x", "c"), ("uint8", "uint16"), "sample"),),
    description="(N, H, W, C) images of one set as a viewer shows them (EXIF orientation "
    "applied), one chunk per image, uint8 or uint16 as the files hold them; file names and "
    "each applied orientation tag in the provenance.",
    checks=(Check("uniform_shape", "Every image of the set has one shape and dtype."),),
)
IMAGE_PATCHES = StoredAsset(
    name="image_patches",
    path="images/patches",
    family="images",
    version="1",
    arrays=(
        ArraySpec("items", ("patch",), "uint32", read="rows"),
        ArraySpec("origins", ("patch", "axis"), "uint16", read="rows"),
        ArraySpec("fraction", ("patch",), "float32", read="rows"),
    ),
    description="Patch origins (image, y, x) whose foreground fraction passes the filter: "
    "training crops first, then processes.",
    params=("patch_yx", "stride_yx", "foreground", "min_foreground_fraction"),
    per_dataset=("patch_yx",),  # the patch dataset crops every patch to one shape
    inputs=(IMAGE_STORE.name,),
    checks=(
        Check("non_empty", "At least one patch passed the filter."),
        Check("in_bounds", "Every index lies inside the array it indexes."),
    ),
)
PATCH_TABLE = Table("patches", IMAGE_PATCHES, ("items", "origins"))


def describe_set(item: RawItem) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    files = item_files(item)
    facts = {"images": len(files), "suffixes": ", ".join(sorted({p.suffix.lower() for p in files}))}
    return facts, bool(files), {"images": len(files)}


def read_set(files: list[Path]) -> np.ndarray:
    """(N, H, W, C) of a folder's images, which must share one shape and dtype."""
    first = read_image(files[0])
    first = first[..., None] if first.ndim == 2 else first
    shape = (len(files), *first.shape)
    what = f"{len(files)} images of {first.dtype} {first.shape}"
    nbytes = claimed_bytes(shape, first.dtype.itemsize)
    require_allocatable(files[0].parent, nbytes, what, BOUND)
    out = np.empty(shape, first.dtype)
    for i, path in enumerate(files):
        img = first if i == 0 else read_image(path)
        img = img[..., None] if img.ndim == 2 else img
        if img.shape != first.shape or img.dtype != first.dtype:
            raise InputError(
                path,
                f"{first.dtype} {first.shape} like {files[0].name}",
                f"{img.dtype} {img.shape}",
            )
        out[i] = img
    return out


def _overlay(image: np.ndarray, origins: np.ndarray, patch: tuple[int, ...]) -> np.ndarray:
    """The image with the outline of every kept patch drawn in red (for the preview)."""
    rgb = np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image[..., :3].copy()
    if rgb.dtype != np.uint8:
        rgb = (rgb.astype(np.float32) / np.iinfo(rgb.dtype).max * 255).astype(np.uint8)
    h, w = patch
    for y, x in origins.astype(int):
        if y + h > rgb.shape[0] or x + w > rgb.shape[1]:
            continue  # an invalid origin is the in_bounds check's business, not the preview's
        rgb[y, x : x + w] = rgb[y + h - 1, x : x + w] = (255, 0, 0)
        rgb[y : y + h, x] = rgb[y : y + h, x + w - 1] = (255, 0, 0)
    return rgb


def store_step(inputs: Inputs, key: str) -> Step:
    item, sha, identity = inputs.source(key)
    watch = inputs.watch(item)
    files = item_files(item)
    if not files:
        raise InputError(item.location, "image files (.png, .jpg, .tif)", "none")

    def check(arrays: dict[str, np.ndarray]) -> Checks:
        arr = arrays["images"]
        ok = arr.ndim == 4 and arr.shape[0] == len(files) and arr.size > 0
        return {"uniform_shape": (ok, {"shape": str(arr.shape), "files": len(files)})}

    return Step(
        inputs=identity,
        source=item.location,
        source_sha256=sha,
        produce=lambda: {"images": read_set(files)},
        check=check,
        describe=lambda a: {
            "images": len(files),
            "preview": Picture(
                image_png(a["images"][0].squeeze(), f"{files[0].name}"),
                f"image 0 of {len(files)}: {files[0].name}",
            ),
        },
        attrs={
            "source_stamp": item.stamp,
            "names": [p.name for p in files],
            "links": inputs.links(item),  # link → target, its hash (ZARRFEED_RAW_LINKS)
            # name → the EXIF orientation tag applied to it (2–8; 1 and none need nothing)
            "exif_orientation": {
                p.name: tag for p in files if (tag := image_orientation(p)) not in (None, 1)
            },
        },
        watch=watch,
    )


def patches_step(inputs: Inputs, key: str) -> Step:
    s = inputs.settings
    images = inputs.read(IMAGE_STORE, key, "images")
    grid = PatchGrid.make(images.shape[1:3], tuple(s["patch_yx"]), tuple(s["stride_yx"]))

    def produce() -> dict[str, np.ndarray]:
        items, origins, fracs = [], [], []
        for i in range(images.shape[0]):
            img = images[i].astype(np.float32) / np.iinfo(images.dtype).max
            gray = to_gray(img) if img.shape[-1] == 3 else img[..., 0]
            f = patch_fractions(gray > s["foreground"], grid)
            keep = np.flatnonzero(f >= s["min_foreground_fraction"])
            items.append(np.full(len(keep), i, np.uint32))
            origins.append(grid.origins(keep).astype(np.uint16))
            fracs.append(f[keep])
        return {
            "items": np.concatenate(items),
            "origins": np.concatenate(origins),
            "fraction": np.concatenate(fracs),
        }

    def check(arrays: dict[str, np.ndarray]) -> Checks:
        items, origins = arrays["items"], arrays["origins"]
        inside = bool(((origins + np.array(grid.patch)) <= np.array(images.shape[1:3])).all())
        inside = inside and (len(items) == 0 or int(items.max()) < images.shape[0])
        return {
            "non_empty": (len(items) > 0, {"patches": len(items)}),
            "in_bounds": (inside, {"patch": list(grid.patch), "image": str(images.shape[1:3])}),
        }

    def describe(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        items, origins = arrays["items"], arrays["origins"]
        overlay = _overlay(images[0], origins[items == 0], grid.patch)
        return {
            "patches_kept": len(items),
            "patches_total": len(grid) * images.shape[0],
            "preview": Picture(
                image_png(overlay, "kept patches in red"), "image 0, its kept patches outlined"
            ),
        }

    return Step(
        inputs=inputs.upstream(key, IMAGE_STORE),
        source=inputs.store.partition_url(IMAGE_STORE.path, key),
        source_sha256=None,
        produce=produce,
        check=check,
        describe=describe,
        attrs={"patch_shape": list(grid.patch)},
    )


def set_files(item: RawItem) -> list[Path]:
    return item_files(item)


# Image patches (N, C, H, W) in [0, 1] with their defect mask (moved alike, nearest pixel).
RECIPE = "image"  # its augmentation recipe: what its tasks augment with by default
AUGMENT: dict[str, Any] = {
    "keys": {"image": "image", "mask": "mask"},
    "flip": Flip(p=0.5, axes=(0, 1)),
    "rot90": Rot90(p=0.5, axes=(0, 1)),
    "affine": Affine(p=0.3, rotate=15.0, scale=(0.9, 1.1), translate=4.0),
    "intensity": Intensity(p=0.5, scale=(0.8, 1.2), shift=(-0.1, 0.1)),
    "gamma": Gamma(p=0.3, range=(0.7, 1.5)),
    "noise": Noise(p=0.2, std=(0.0, 0.03)),
    "blur": Blur(p=0.2, sigma=(0.5, 1.0)),
}

IMAGES = Family(
    name="images",
    partitions="image_sets",
    raw=RawSource(
        asset="image_raw_set",
        items="image sets",
        description="A folder of images: one hash over its files (the data version), count "
        "and bytes.",
        kinds=frozenset({"png", "tiff"}),
        scan=scan_images,
        files=set_files,
        describe=describe_set,
        readable=Check("readable", "The folder holds at least one image file."),
        version="2",
    ),
    settings=ImageSettings,
    stages=(Stage(IMAGE_STORE, store_step), Stage(IMAGE_PATCHES, patches_step)),
    tables=(PATCH_TABLE,),
    dataset_version="2",
    readers=(Reader("images", "zarrfeed.families.images.datasets:ImagePatchDataset"),),
    tasks=("zarrfeed.families.images.tasks:DefectSegmentation",),
    augment={RECIPE: AUGMENT},
)
