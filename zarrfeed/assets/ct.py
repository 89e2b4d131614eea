"""CT branch: raw scan → HU volume → windowed volumes → sparse indices, and the patch index.

Each asset reads, transforms (``zarrfeed.transforms``), writes (``zarrfeed.store``) and
reports; checks always run on what the store holds, so a reused partition is re-verified.
The raw asset's content hash is its data version, so a changed file makes only its own
partitions stale.
"""

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import dagster as dg
import numpy as np

from zarrfeed.assets.build import (
    Built,
    checked_arrays,
    fingerprint,
    materialize_partitions,
    partitioned_asset,
    partitioned_multi_asset,
    report,
    reuse,
    upstream_input,
)
from zarrfeed.assets.metadata import preview
from zarrfeed.assets.partitions import ct_scans
from zarrfeed.formats import read_nifti, read_nifti_header
from zarrfeed.formats.discover import rescale_from_metadata
from zarrfeed.resources import BuildOptions, CTSettings, RawFolderResource, ZarrStoreResource
from zarrfeed.store import ZarrStore, file_sha256, provenance
from zarrfeed.transforms import ct
from zarrfeed.transforms.patches import PatchGrid, patch_fractions
from zarrfeed.transforms.sparse import window_occupancy
from zarrfeed.transforms.stats import finite_range

HU_ASSET, WINDOWS_ASSET, SPARSE_ASSET, PATCHES_ASSET = (
    "ct/hu",
    "ct/windows",
    "ct/sparse",
    "ct/patches",
)
CT_STORE_ASSETS = (HU_ASSET, WINDOWS_ASSET, SPARSE_ASSET, PATCHES_ASSET)
VERSIONS = {HU_ASSET: "1", WINDOWS_ASSET: "1", SPARSE_ASSET: "1", PATCHES_ASSET: "1"}
VERIFY_POINTS = 2048
HuReader = Callable[[str], np.ndarray]  # partition key -> its HU volume


def _raw_path(scans: dict[str, Path], key: str, root: str) -> Path:
    path = scans.get(key)
    if path is None:
        raise dg.Failure(f"no raw CT file for scan {key!r} under {root} (was it removed?)")
    return path


@partitioned_asset(
    partitions_def=ct_scans,
    group="ct",
    code_version="1",
    checks=("readable",),
    batched=False,
)
def ct_raw_scan(context: dg.AssetExecutionContext, raw: RawFolderResource) -> dg.MaterializeResult:
    """A raw CT file: its content hash (the data version) and its header facts.

    Runs one partition per run (no batching): Dagster 1.13 keeps one data version per step,
    and this per-file hash is what makes exactly the changed scan's partitions stale.
    """
    path = _raw_path(raw.ct_scans(), context.partition_key, raw.root)
    sha = file_sha256(path)
    vol = read_nifti_header(path)  # the voxels are decoded (and checked) by ct_hu
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha),
        metadata={
            "path": dg.MetadataValue.path(str(path)),
            "sha256": sha,
            "shape_zyx": str(vol.shape),
            "spacing_zyx_mm": str(tuple(round(s, 4) for s in vol.spacing)),
            "stored_dtype": vol.meta["dtype"],
            "orientation_on_disk": vol.meta["orientation_on_disk"],
            "file_bytes": path.stat().st_size,
        },
        check_results=[
            dg.AssetCheckResult(
                check_name="readable",
                passed=min(vol.shape) > 1 and min(vol.spacing) > 0,
                metadata={"shape": str(vol.shape), "spacing": str(vol.spacing)},
            )
        ],
    )


@partitioned_asset(
    partitions_def=ct_scans,
    group="ct",
    code_version=VERSIONS[HU_ASSET],
    checks=("hu_range", "matches_source"),
    deps=(ct_raw_scan,),
)
def ct_hu(
    context: dg.AssetExecutionContext,
    raw: RawFolderResource,
    zarr_store: ZarrStoreResource,
    ct_settings: CTSettings,
    build: BuildOptions,
) -> dg.MaterializeResult:
    """HU volume (int16) resampled to the configured spacing and clipped to [−1024, 3071]."""
    store, scans, csv_rows = zarr_store.store(), raw.ct_scans(), raw.ct_metadata()
    preset = replace(ct.HU_ISOTROPIC, spacing=tuple(ct_settings.spacing_zyx_mm))

    def one(key: str) -> Built:
        path = _raw_path(scans, key, raw.root)
        # Hash the bytes this run reads, not ct_raw_scan's recorded version: the file may
        # have changed since the last ingest, and provenance must describe what was used.
        sha = file_sha256(path)
        slope, intercept = rescale_from_metadata(csv_rows.get(key))
        params = {**preset.params(), "slope": slope, "intercept": intercept}
        fp = fingerprint(VERSIONS[HU_ASSET], params, {"source_sha256": sha})
        vol = read_nifti(path)
        already_hu = ct.is_hu(vol.data)
        hu = ct.to_hu(vol.data, slope, intercept, already_hu)
        seconds, fresh = None, None
        if not reuse(store, HU_ASSET, key, fp, build.force):
            t0 = time.perf_counter()
            out = ct.preprocess(hu, vol.spacing, preset)
            fresh = {"hu": out}
            attrs = provenance(
                str(path),
                sha,
                VERSIONS[HU_ASSET],
                {**params, "source_in_hu": already_hu},
                source_spacing_zyx_mm=vol.spacing,
                fingerprint=fp,
            )
            with store.write_partition(HU_ASSET, key, attrs) as w:
                w.write("hu", out, dimension_names=("z", "y", "x"))
            seconds = time.perf_counter() - t0
        out = checked_arrays(store, HU_ASSET, key, fresh)["hu"]
        lo, hi = preset.clip
        rng = np.random.default_rng(0)
        points = np.stack([rng.integers(0, n, VERIFY_POINTS) for n in out.shape], axis=1)
        expected = np.clip(ct.sample_resampled(hu, out.shape, points), lo, hi)
        error = float(np.abs(out[tuple(points.T)] - expected).max())
        shape_ok = out.shape == ct.resampled_shape(hu.shape, vol.spacing, preset.spacing)
        return Built(
            metadata=report(
                store,
                HU_ASSET,
                key,
                seconds,
                source_in_hu=already_hu,
                preview=preview(ct.apply_window(out[out.shape[0] // 2], "lung", "float32")),
            ),
            checks={
                "hu_range": (
                    bool(
                        out.dtype == np.int16 and out.size and out.min() >= lo and out.max() <= hi
                    ),
                    {"min": int(out.min()), "max": int(out.max()), "dtype": str(out.dtype)},
                ),
                # Rounding to int16 is the only difference allowed against the recomputation.
                "matches_source": (
                    shape_ok and error <= 1.0,
                    {"max_abs_error_hu": error, "points": VERIFY_POINTS, "shape_ok": shape_ok},
                ),
            },
        )

    return materialize_partitions(context, one)


def _windows(
    store: ZarrStore, ct_settings: CTSettings, force: bool, hu_of: HuReader
) -> Callable[[str], Built]:
    """float16 windows in [0, 1], one array per configured window, chunked for 64³ patches."""
    params = {n: vars(ct.get_window(n)) for n in ct_settings.windows}

    def one(key: str) -> Built:
        source = upstream_input(store, HU_ASSET, key)
        fp = fingerprint(VERSIONS[WINDOWS_ASSET], params, {"hu": source})
        seconds, fresh = None, None
        if not reuse(store, WINDOWS_ASSET, key, fp, force):
            t0 = time.perf_counter()
            hu = hu_of(key)
            fresh = {name: ct.apply_window(hu, name) for name in params}
            attrs = provenance(
                store.path(HU_ASSET, key),
                source["sha"],
                VERSIONS[WINDOWS_ASSET],
                params,
                fingerprint=fp,
            )
            with store.write_partition(WINDOWS_ASSET, key, attrs) as w:
                for name, data in fresh.items():
                    w.write(name, data, dimension_names=("z", "y", "x"))
            seconds = time.perf_counter() - t0
        bad, first = {}, None
        for name, d in checked_arrays(store, WINDOWS_ASSET, key, fresh).items():
            first = d if first is None else first
            lo, hi, finite = finite_range(d)
            if not (d.dtype == np.float16 and finite and lo >= 0 and hi <= 1):
                bad[name] = [str(d.dtype), lo, hi, finite]
        return Built(
            metadata=report(
                store,
                WINDOWS_ASSET,
                key,
                seconds,
                windows=", ".join(params),
                preview=preview(first[first.shape[0] // 2]),
            ),
            checks={"window_range": (not bad, {"out_of_range": bad})},
        )

    return one


def _sparse(
    store: ZarrStore, ct_settings: CTSettings, force: bool, hu_of: HuReader
) -> Callable[[str], Built]:
    """uint16 (N, 3) coordinates of occupied voxels per window (TRELLIS-style sparse structure).

    Occupied = windowed value above ``sparse_threshold``; on a ``sparse_grid``³ occupancy grid
    (a cell is on if any voxel in it is), or at full resolution when the grid is 0.  Computed
    from the HU volume in one pass for every window (``sparse.window_occupancy``), equal bit
    for bit to thresholding the stored windows.
    """
    grid = ct_settings.sparse_grid or None
    params = {"threshold": ct_settings.sparse_threshold, "grid": grid}

    def one(key: str) -> Built:
        inputs = {
            "hu": upstream_input(store, HU_ASSET, key),
            "windows": upstream_input(store, WINDOWS_ASSET, key),
        }
        fp = fingerprint(VERSIONS[SPARSE_ASSET], params, inputs)
        names = sorted(store.open_partition(WINDOWS_ASSET, key).array_keys())
        hu = store.open_array(HU_ASSET, key, "hu")
        seconds, fresh = None, None
        if not reuse(store, SPARSE_ASSET, key, fp, force):
            t0 = time.perf_counter()
            attrs = provenance(
                store.path(HU_ASSET, key),
                inputs["hu"]["sha"],
                VERSIONS[SPARSE_ASSET],
                params,
                fingerprint=fp,
            )
            threshold = ct_settings.sparse_threshold
            fresh = window_occupancy(hu_of(key), names, threshold, grid)
            with store.write_partition(SPARSE_ASSET, key, attrs) as w:
                for name, coords in fresh.items():
                    w.write(name, coords, read="rows", dimension_names=("point", "axis"))
            seconds = time.perf_counter() - t0
        counts, out_of_bounds = {}, {}
        for name, coords in checked_arrays(store, SPARSE_ASSET, key, fresh).items():
            bound = np.array((grid,) * 3 if grid else hu.shape)
            counts[name] = len(coords)
            if coords.dtype != np.uint16 or coords.ndim != 2 or (coords >= bound).any():
                out_of_bounds[name] = str(coords.dtype)
        return Built(
            metadata=report(
                store, SPARSE_ASSET, key, seconds, points=dg.MetadataValue.json(counts)
            ),
            checks={
                "min_points": (
                    min(counts.values()) >= ct_settings.min_points,
                    {"points": counts, "min_points": ct_settings.min_points},
                ),
                "in_bounds": (not out_of_bounds, {"bad": out_of_bounds}),
            },
        )

    return one


def _patches(
    store: ZarrStore, ct_settings: CTSettings, force: bool, hu_of: HuReader
) -> Callable[[str], Built]:
    """Origins of the patches (of the windowed volumes) that are mostly body, with fractions.

    Training samples patches from this index instead of rejecting air patches at load time.
    """
    patch, stride = tuple(ct_settings.patch_zyx), tuple(ct_settings.patch_stride_zyx)
    params = {
        "patch": patch,
        "stride": stride,
        "body_hu": ct_settings.body_hu,
        "min_fraction": ct_settings.min_body_fraction,
    }

    def one(key: str) -> Built:
        inputs = {"hu": upstream_input(store, HU_ASSET, key)}
        fp = fingerprint(VERSIONS[PATCHES_ASSET], params, inputs)
        hu = store.open_array(HU_ASSET, key, "hu")
        grid = PatchGrid.make(
            hu.shape, tuple(min(p, n) for p, n in zip(patch, hu.shape, strict=True)), stride
        )
        seconds, fresh = None, None
        if not reuse(store, PATCHES_ASSET, key, fp, force):
            t0 = time.perf_counter()
            body = hu_of(key) > ct_settings.body_hu
            fractions = patch_fractions(body, grid)
            keep = np.flatnonzero(fractions >= ct_settings.min_body_fraction)
            attrs = provenance(
                store.path(HU_ASSET, key),
                inputs["hu"]["sha"],
                VERSIONS[PATCHES_ASSET],
                params,
                fingerprint=fp,
                volume_shape=list(hu.shape),
                patch_shape=list(grid.patch),
            )
            fresh = {"origins": grid.origins(keep).astype(np.uint16), "fraction": fractions[keep]}
            with store.write_partition(PATCHES_ASSET, key, attrs) as w:
                for name, data in fresh.items():
                    w.write(name, data, read="rows")
            seconds = time.perf_counter() - t0
        arrays = checked_arrays(store, PATCHES_ASSET, key, fresh)
        origins, frac = arrays["origins"], arrays["fraction"]
        inside = bool(((origins + np.array(grid.patch)) <= np.array(hu.shape)).all())
        return Built(
            metadata=report(
                store,
                PATCHES_ASSET,
                key,
                seconds,
                patches_kept=len(origins),
                patches_total=len(grid),
            ),
            checks={
                "non_empty": (len(origins) > 0, {"patches": len(origins), "of": len(grid)}),
                "in_bounds": (
                    inside and bool((frac >= ct_settings.min_body_fraction).all()),
                    {"patch": list(grid.patch), "volume": list(hu.shape)},
                ),
            },
        )

    return one


# asset -> (code version, blocking checks, deps, builder); one step builds any subset.
CT_DERIVED = {
    "ct_windows": (VERSIONS[WINDOWS_ASSET], ("window_range",), ("ct_hu",), _windows),
    "ct_sparse": (
        VERSIONS[SPARSE_ASSET],
        ("min_points", "in_bounds"),
        ("ct_hu", "ct_windows"),
        _sparse,
    ),
    "ct_patches": (
        VERSIONS[PATCHES_ASSET],
        ("non_empty", "in_bounds"),
        ("ct_hu", "ct_windows"),
        _patches,
    ),
}


@partitioned_multi_asset(name="ct_derived", partitions_def=ct_scans, group="ct", assets=CT_DERIVED)
def ct_derived(
    context: dg.AssetExecutionContext,
    zarr_store: ZarrStoreResource,
    ct_settings: CTSettings,
    build: BuildOptions,
) -> Iterator[dg.MaterializeResult]:
    """Windows, sparse indices and patch index of a scan in one step (any subset of them).

    All three are computed from the HU volume, read once per partition here; as separate
    steps each paid Dagster's per-step cost (~0.2 s: events, resources, checks) and its own
    read of the volume.
    """
    store = zarr_store.store()
    hu_of = functools.lru_cache(maxsize=1)(lambda key: store.read_array(HU_ASSET, key, "hu"))
    for name, (*_, builder) in CT_DERIVED.items():
        if dg.AssetKey(name) in context.selected_asset_keys:
            one = builder(store, ct_settings, build.force, hu_of)
            yield materialize_partitions(context, one, dg.AssetKey(name))
