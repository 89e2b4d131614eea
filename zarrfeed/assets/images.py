"""Image branch (seed 002): raw image set → image store → patch index.

Training crops patches first and processes them after (seed 002's lesson), so the index of
useful patch origins is built once here rather than by rejection at load time.
"""

import hashlib
import time
from pathlib import Path

import dagster as dg
import numpy as np

from zarrfeed.assets.build import (
    Built,
    fingerprint,
    materialize_partitions,
    partitioned_asset,
    report,
    reuse,
    upstream_input,
)
from zarrfeed.assets.metadata import preview
from zarrfeed.assets.partitions import image_sets
from zarrfeed.errors import InputError
from zarrfeed.formats import read_image
from zarrfeed.formats.discover import image_files
from zarrfeed.resources import BuildOptions, ImageSettings, RawFolderResource, ZarrStoreResource
from zarrfeed.store import file_sha256, provenance
from zarrfeed.transforms.patches import PatchGrid, patch_fractions
from zarrfeed.transforms.spike import to_gray

IMAGES_ASSET, IMAGE_PATCHES_ASSET = "images/images", "images/patches"
IMAGE_STORE_ASSETS = (IMAGES_ASSET, IMAGE_PATCHES_ASSET)
VERSIONS = {IMAGES_ASSET: "1", IMAGE_PATCHES_ASSET: "1"}


def _files(raw: RawFolderResource, found: dict[str, Path], key: str) -> list[Path]:
    folder = found.get(key)
    files = image_files(folder) if folder is not None else []
    if not files:
        raise dg.Failure(f"no image set {key!r} under {raw.root} (was it removed?)")
    return files


def files_sha256(files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.name}\0{file_sha256(path)}\n".encode())
    return h.hexdigest()


@partitioned_asset(
    partitions_def=image_sets,
    group="images",
    code_version="1",
    checks=("non_empty",),
    batched=False,
)
def image_raw_set(
    context: dg.AssetExecutionContext, raw: RawFolderResource
) -> dg.MaterializeResult:
    """A folder of images: one hash over its files (the data version), count and bytes."""
    files = _files(raw, raw.image_sets(), context.partition_key)
    return dg.MaterializeResult(
        data_version=dg.DataVersion(files_sha256(files)),
        metadata={
            "path": dg.MetadataValue.path(str(files[0].parent)),
            "images": len(files),
            "file_bytes": sum(p.stat().st_size for p in files),
            "suffixes": ", ".join(sorted({p.suffix.lower() for p in files})),
        },
        check_results=[dg.AssetCheckResult(check_name="non_empty", passed=bool(files))],
    )


@partitioned_asset(
    partitions_def=image_sets,
    group="images",
    code_version=VERSIONS[IMAGES_ASSET],
    checks=("uniform_shape",),
    deps=(image_raw_set,),
)
def image_store(
    context: dg.AssetExecutionContext,
    raw: RawFolderResource,
    zarr_store: ZarrStoreResource,
    build: BuildOptions,
) -> dg.MaterializeResult:
    """(N, H, W, C) images of one set, one chunk per image; file names in the attributes."""
    store, found = zarr_store.store(), raw.image_sets()

    def one(key: str) -> Built:
        files = _files(raw, found, key)
        sha = files_sha256(files)
        params = {"names": [p.name for p in files]}
        fp = fingerprint(VERSIONS[IMAGES_ASSET], params, {"source_sha256": sha})
        seconds = None
        if not reuse(store, IMAGES_ASSET, key, fp, build.force):
            t0 = time.perf_counter()
            first = read_image(files[0])
            first = first[..., None] if first.ndim == 2 else first
            attrs = provenance(
                str(files[0].parent), sha, VERSIONS[IMAGES_ASSET], params, fingerprint=fp
            )
            with store.write_partition(IMAGES_ASSET, key, attrs) as w:
                shape = (len(files), *first.shape)
                arr = w.create(
                    "images",
                    shape,
                    first.dtype,
                    chunks=(1, *first.shape),
                    dimension_names=("image", "y", "x", "c"),
                )
                for i, path in enumerate(files):
                    img = first if i == 0 else read_image(path)
                    img = img[..., None] if img.ndim == 2 else img
                    if img.shape != first.shape or img.dtype != first.dtype:
                        raise InputError(
                            path,
                            f"{first.dtype} {first.shape} like {files[0].name}",
                            f"{img.dtype} {img.shape}",
                        )
                    arr[i] = img
            seconds = time.perf_counter() - t0
        arr = store.open_array(IMAGES_ASSET, key, "images")
        ok = arr.ndim == 4 and arr.shape[0] == len(files) and arr.size > 0
        return Built(
            metadata=report(
                store,
                IMAGES_ASSET,
                key,
                seconds,
                images=len(files),
                preview=preview(arr[0].squeeze(), "image 0"),
            ),
            checks={"uniform_shape": (ok, {"shape": str(arr.shape), "files": len(files)})},
        )

    return materialize_partitions(context, one)


@partitioned_asset(
    partitions_def=image_sets,
    group="images",
    code_version=VERSIONS[IMAGE_PATCHES_ASSET],
    checks=("non_empty", "in_bounds"),
    deps=(image_store,),
)
def image_patches(
    context: dg.AssetExecutionContext,
    zarr_store: ZarrStoreResource,
    image_settings: ImageSettings,
    build: BuildOptions,
) -> dg.MaterializeResult:
    """Patch origins (image id, y, x) whose foreground fraction passes the filter."""
    store, s = zarr_store.store(), image_settings
    params = {
        "patch": s.patch_yx,
        "stride": s.stride_yx,
        "foreground": s.foreground,
        "min_fraction": s.min_foreground_fraction,
    }

    def one(key: str) -> Built:
        source = upstream_input(store, IMAGES_ASSET, key)
        fp = fingerprint(VERSIONS[IMAGE_PATCHES_ASSET], params, {"images": source})
        images = store.open_array(IMAGES_ASSET, key, "images")
        grid = PatchGrid.make(images.shape[1:3], tuple(s.patch_yx), tuple(s.stride_yx))
        seconds = None
        if not reuse(store, IMAGE_PATCHES_ASSET, key, fp, build.force):
            t0 = time.perf_counter()
            items, origins, fracs = [], [], []
            for i in range(images.shape[0]):
                img = images[i].astype(np.float32) / np.iinfo(images.dtype).max
                gray = to_gray(img) if img.shape[-1] == 3 else img[..., 0]
                f = patch_fractions(gray > s.foreground, grid)
                keep = np.flatnonzero(f >= s.min_foreground_fraction)
                items.append(np.full(len(keep), i, np.uint32))
                origins.append(grid.origins(keep).astype(np.uint16))
                fracs.append(f[keep])
            attrs = provenance(
                store.path(IMAGES_ASSET, key),
                source["sha"],
                VERSIONS[IMAGE_PATCHES_ASSET],
                params,
                fingerprint=fp,
                patch_shape=list(grid.patch),
            )
            with store.write_partition(IMAGE_PATCHES_ASSET, key, attrs) as w:
                w.write("items", np.concatenate(items), read="rows")
                w.write("origins", np.concatenate(origins), read="rows")
                w.write("fraction", np.concatenate(fracs), read="rows")
            seconds = time.perf_counter() - t0
        group = store.open_partition(IMAGE_PATCHES_ASSET, key)
        items, origins = group["items"][...], group["origins"][...]
        inside = bool(((origins + np.array(grid.patch)) <= np.array(images.shape[1:3])).all()) and (
            len(items) == 0 or int(items.max()) < images.shape[0]
        )
        return Built(
            metadata=report(
                store,
                IMAGE_PATCHES_ASSET,
                key,
                seconds,
                patches_kept=len(items),
                patches_total=len(grid) * images.shape[0],
                preview=preview(
                    _grid_overlay(images[0], origins[items == 0], grid.patch),
                    "image 0 with kept patches",
                ),
            ),
            checks={
                "non_empty": (len(items) > 0, {"patches": len(items)}),
                "in_bounds": (inside, {"patch": list(grid.patch), "image": str(images.shape[1:3])}),
            },
        )

    return materialize_partitions(context, one)


def _grid_overlay(image: np.ndarray, origins: np.ndarray, patch: tuple[int, ...]) -> np.ndarray:
    """The image with the outline of every kept patch drawn in red (for the preview)."""
    rgb = np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image[..., :3].copy()
    h, w = patch
    for y, x in origins.astype(int):
        if y + h > rgb.shape[0] or x + w > rgb.shape[1]:
            continue  # an invalid origin is the in_bounds check's business, not the preview's
        rgb[y, x : x + w] = rgb[y + h - 1, x : x + w] = (255, 0, 0)
        rgb[y : y + h, x] = rgb[y : y + h, x + w - 1] = (255, 0, 0)
    return rgb
