"""Image family: raw image set → image store → patch index.

Training crops patches first and processes them after, so the index of useful patch origins
is built once here rather than by rejection at load time.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np

from zarrfeed.assets.build import (
    Step,
    build_partition,
    materialize_partitions,
    stored_asset,
    upstream,
)
from zarrfeed.assets.metadata import png_markdown
from zarrfeed.assets.partitions import image_sets
from zarrfeed.assets.raw import content_hash, raw_asset, resolve
from zarrfeed.errors import InputError
from zarrfeed.formats import read_image
from zarrfeed.formats.discover import image_files
from zarrfeed.formats.limits import claimed_bytes, require_allocatable
from zarrfeed.formats.previews import image_png
from zarrfeed.resources import BuildOptions, ImageSettings, ZarrStoreResource
from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import SourceWatch, source_identity
from zarrfeed.store import ZarrStore
from zarrfeed.store.contract import FAMILIES, IMAGE_PATCHES, IMAGE_STORE, SOURCE
from zarrfeed.transforms.patches import PatchGrid, patch_fractions
from zarrfeed.transforms.spike import to_gray


def describe_set(item: RawItem) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    files = image_files(Path(item.location))
    facts = {"images": len(files), "suffixes": ", ".join(sorted({p.suffix.lower() for p in files}))}
    return facts, bool(files), {"images": len(files)}


def read_set(files: list[Path]) -> np.ndarray:
    """(N, H, W, C) of a folder's images, which must share one shape and dtype."""
    first = read_image(files[0])
    first = first[..., None] if first.ndim == 2 else first
    shape = (len(files), *first.shape)
    what = f"{len(files)} images of {first.dtype} {first.shape}"
    require_allocatable(files[0].parent, claimed_bytes(shape, first.dtype.itemsize), what, "images")
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


def _store_step(catalog, key: str) -> Step:
    item = resolve(catalog, key)
    sha = content_hash(catalog, item)
    watch = SourceWatch(item)
    files = image_files(Path(item.location))
    if not files:
        raise InputError(item.location, "image files (.png, .jpg, .tif)", "none")

    def check(arrays: dict[str, np.ndarray]) -> dict:
        arr = arrays["images"]
        ok = arr.ndim == 4 and arr.shape[0] == len(files) and arr.size > 0
        return {"uniform_shape": (ok, {"shape": str(arr.shape), "files": len(files)})}

    return Step(
        inputs={SOURCE: source_identity(item, sha)},
        source=item.location,
        source_sha256=sha,
        produce=lambda: {"images": read_set(files)},
        check=check,
        describe=lambda a: {
            "images": len(files),
            "preview": png_markdown(
                image_png(a["images"][0].squeeze(), f"{files[0].name}"),
                f"image 0 of {len(files)}: {files[0].name}",
            ),
        },
        attrs={"source_stamp": item.stamp, "names": [p.name for p in files]},
        watch=watch,
    )


def _patches_step(store: ZarrStore, s: Mapping[str, Any], key: str) -> Step:
    images = store.read_array(IMAGE_STORE.path, key, "images")
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

    def check(arrays: dict[str, np.ndarray]) -> dict:
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
            "preview": png_markdown(
                image_png(overlay, "kept patches in red"), "image 0, its kept patches outlined"
            ),
        }

    return Step(
        inputs={"image_store": upstream(store, IMAGE_STORE, key)},
        source=store.partition_url(IMAGE_STORE.path, key),
        source_sha256=None,
        produce=produce,
        check=check,
        describe=describe,
        attrs={"patch_shape": list(grid.patch)},
    )


def image_assets(settings: Mapping[str, Any]) -> list[dg.AssetsDefinition]:
    """The image family's assets, their code versions derived from ``settings``."""
    raw = raw_asset(
        FAMILIES["images"],
        describe_set,
        "A folder of images: one hash over its files (the data version), count and bytes.",
    )

    @stored_asset(IMAGE_STORE, settings, image_sets, deps=[raw.key.path[0]])
    def image_store(
        context: dg.AssetExecutionContext, zarr_store: ZarrStoreResource, build: BuildOptions
    ) -> dg.MaterializeResult:
        store, catalog = zarr_store.store(), zarr_store.catalog("images")
        return materialize_partitions(
            context,
            lambda key: build_partition(
                store, IMAGE_STORE, key, {}, build.force, _store_step(catalog, key)
            ),
        )

    @stored_asset(IMAGE_PATCHES, settings, image_sets, deps=["image_store"])
    def image_patches(
        context: dg.AssetExecutionContext,
        zarr_store: ZarrStoreResource,
        image_settings: ImageSettings,
        build: BuildOptions,
    ) -> dg.MaterializeResult:
        store, values = zarr_store.store(), image_settings.values()
        return materialize_partitions(
            context,
            lambda key: build_partition(
                store, IMAGE_PATCHES, key, values, build.force, _patches_step(store, values, key)
            ),
        )

    return [raw, image_store, image_patches]
