"""CT branch: raw scan → HU volume at a fixed spacing → windowed volumes.

Each asset body reads, transforms (``zarrfeed.transforms``), writes (``zarrfeed.store``) and
reports; the raw asset's content hash is its data version, so a changed file makes only its
own partitions stale.
"""

import time
from dataclasses import replace

import dagster as dg
import numpy as np

from zarrfeed.assets.metadata import partition_metadata, preview
from zarrfeed.assets.partitions import ct_scans
from zarrfeed.formats import read_nifti
from zarrfeed.formats.discover import rescale_from_metadata
from zarrfeed.resources import CTSettings, RawFolderResource, ZarrStoreResource
from zarrfeed.store import file_sha256, provenance
from zarrfeed.transforms import ct

HU_ASSET, WINDOWS_ASSET = "ct/hu", "ct/windows"
VERIFY_POINTS = 2048


def _raw_path(raw: RawFolderResource, key: str):
    path = raw.ct_scans().get(key)
    if path is None:
        raise dg.Failure(f"no raw CT file for scan {key!r} under {raw.root} (was it removed?)")
    return path


@dg.asset(partitions_def=ct_scans, group_name="ct", code_version="1")
def ct_raw_scan(context: dg.AssetExecutionContext, raw: RawFolderResource) -> dg.MaterializeResult:
    """A raw CT file: its content hash (the data version) and its header facts."""
    path = _raw_path(raw, context.partition_key)
    sha = file_sha256(path)
    vol = read_nifti(path)
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha),
        metadata={
            "path": dg.MetadataValue.path(str(path)),
            "sha256": sha,
            "shape_zyx": str(vol.shape),
            "spacing_zyx_mm": str(tuple(round(s, 4) for s in vol.spacing)),
            "stored_dtype": str(vol.data.dtype),
            "stores_hu": ct.is_hu(vol.data),
            "orientation_on_disk": vol.meta["orientation_on_disk"],
            "file_bytes": path.stat().st_size,
        },
    )


@dg.asset(
    partitions_def=ct_scans,
    deps=[ct_raw_scan],
    group_name="ct",
    code_version="1",
    check_specs=[
        dg.AssetCheckSpec("hu_range", asset="ct_hu", blocking=True),
        dg.AssetCheckSpec("matches_source", asset="ct_hu", blocking=True),
    ],
)
def ct_hu(
    context: dg.AssetExecutionContext,
    raw: RawFolderResource,
    zarr_store: ZarrStoreResource,
    ct_settings: CTSettings,
) -> dg.MaterializeResult:
    """HU volume (int16) resampled to the configured spacing and clipped to [−1024, 3071]."""
    key = context.partition_key
    path = _raw_path(raw, key)
    t0 = time.perf_counter()
    vol = read_nifti(path)
    slope, intercept = rescale_from_metadata(raw.ct_metadata().get(key))
    already_hu = ct.is_hu(vol.data)
    hu = ct.to_hu(vol.data, slope, intercept, already_hu)
    preset = replace(ct.HU_ISOTROPIC, spacing=tuple(ct_settings.spacing_zyx_mm))
    out = ct.preprocess(hu, vol.spacing, preset)
    params = {**preset.params(), "slope": slope, "intercept": intercept, "source_in_hu": already_hu}
    store = zarr_store.store()
    # Hash the bytes this run read, not ct_raw_scan's recorded version: the file may have
    # changed since the last ingest, and provenance must describe what was actually used.
    attrs = provenance(str(path), file_sha256(path), "1", params, source_spacing_zyx_mm=vol.spacing)
    with store.write_partition(HU_ASSET, key, attrs) as w:
        w.write("hu", out, dimension_names=("z", "y", "x"))
    seconds = time.perf_counter() - t0

    lo, hi = preset.clip
    rng = np.random.default_rng(0)
    points = np.stack([rng.integers(0, n, VERIFY_POINTS) for n in out.shape], axis=1)
    expected = np.clip(ct.sample_resampled(hu, out.shape, points), lo, hi)
    error = float(np.abs(out[tuple(points.T)] - expected).max())
    return dg.MaterializeResult(
        metadata={
            **partition_metadata(store, HU_ASSET, key, seconds),
            "source_in_hu": already_hu,
            "preview": preview(ct.apply_window(out[out.shape[0] // 2], "lung", "float32")),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name="hu_range",
                passed=bool(out.size and out.min() >= lo and out.max() <= hi),
                metadata={"min": int(out.min()), "max": int(out.max())},
            ),
            dg.AssetCheckResult(
                check_name="matches_source",
                passed=error <= 1.0,  # rounding to int16 is the only allowed difference
                metadata={"max_abs_error_hu": error, "points": VERIFY_POINTS},
            ),
        ],
    )


@dg.asset(
    partitions_def=ct_scans,
    deps=[ct_hu],
    group_name="ct",
    code_version="1",
    check_specs=[dg.AssetCheckSpec("window_range", asset="ct_windows", blocking=True)],
)
def ct_windows(
    context: dg.AssetExecutionContext, zarr_store: ZarrStoreResource, ct_settings: CTSettings
) -> dg.MaterializeResult:
    """float16 windows in [0, 1], one array per configured window, chunked for 64³ patches."""
    key = context.partition_key
    store = zarr_store.store()
    t0 = time.perf_counter()
    hu = store.open_array(HU_ASSET, key, "hu")[...]
    source = store.commit_record(HU_ASSET, key)["attrs"]
    windows = {name: ct.apply_window(hu, name) for name in ct_settings.windows}
    attrs = provenance(store.path(HU_ASSET, key), source.get("source_sha256"), "1",
                       {n: vars(ct.get_window(n)) for n in windows})  # fmt: skip
    with store.write_partition(WINDOWS_ASSET, key, attrs) as w:
        for name, data in windows.items():
            w.write(name, data, dimension_names=("z", "y", "x"))
    seconds = time.perf_counter() - t0
    bad = {n: [float(d.min()), float(d.max())] for n, d in windows.items()
           if not (np.isfinite(d).all() and d.min() >= 0 and d.max() <= 1)}  # fmt: skip
    first = next(iter(windows.values()))
    return dg.MaterializeResult(
        metadata={
            **partition_metadata(store, WINDOWS_ASSET, key, seconds),
            "windows": ", ".join(windows),
            "preview": preview(first[first.shape[0] // 2]),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name="window_range", passed=not bad, metadata={"out_of_range": bad}
            )
        ],
    )
