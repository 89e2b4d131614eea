"""CT-RATE from the Hugging Face hub: a catalog (listing, labels, reports) and, per volume,
download → CT-CLIP preprocessing (float16 240×480×480) → the store.

A committed volume built from the same file (LFS sha256) and preset is reused without
downloading, so a rerun after an interruption fetches only what is missing.
"""

import time

import dagster as dg
import numpy as np

from zarrfeed.assets.build import (
    Built,
    checked_arrays,
    fingerprint,
    materialize_partitions,
    partitioned_asset,
    report,
    reuse,
)
from zarrfeed.assets.metadata import preview
from zarrfeed.assets.partitions import hub_ct_scans
from zarrfeed.formats import read_nifti
from zarrfeed.formats.discover import (
    read_ct_rate_labels,
    read_ct_rate_metadata,
    read_ct_rate_reports,
    rescale_from_metadata,
)
from zarrfeed.resources import BuildOptions, HuggingFaceResource, ZarrStoreResource
from zarrfeed.sources import HubVolume
from zarrfeed.store import provenance
from zarrfeed.transforms import ct
from zarrfeed.transforms.stats import finite_range

CATALOG_ASSET, VOLUME_ASSET = "hub/catalog", "hub/ctclip"
VOLUME_VERSION = "1"


@dg.asset(
    group_name="hub",
    code_version="1",
    check_specs=[dg.AssetCheckSpec("non_empty", asset="hub_ct_catalog", blocking=True)],
)
def hub_ct_catalog(
    context: dg.AssetExecutionContext, hf: HuggingFaceResource, zarr_store: ZarrStoreResource
) -> dg.MaterializeResult:
    """The split's volumes (one partition each), labels and reports at a pinned commit."""
    hub, store = hf.hub(), zarr_store.store()
    sha, volumes = hub.volumes()
    keys = sorted(volumes)
    known = set(context.instance.get_dynamic_partitions(hub_ct_scans.name))
    context.instance.add_dynamic_partitions(hub_ct_scans.name, [k for k in keys if k not in known])
    labels_csv, reports_csv = hub.table("labels", sha), hub.table("reports", sha)
    names, rows = read_ct_rate_labels(labels_csv.parent) if labels_csv else ([], {})
    reports = read_ct_rate_reports(reports_csv.parent) if reports_csv else {}
    text = [reports.get(k, "") for k in keys]
    blob = "".join(text).encode()
    offsets = np.cumsum([0, *(len(t.encode()) for t in text)], dtype=np.int64)
    attrs = provenance(
        f"hf://datasets/{hf.repo_id}@{sha}",
        None,
        "1",
        {"split": hf.split, "revision": hf.revision},
        revision_sha=sha,
        keys=keys,
        label_names=names,
        files={k: [volumes[k].path, volumes[k].size, volumes[k].sha256] for k in keys},
    )
    with store.write_partition(CATALOG_ASSET, hf.split, attrs) as w:
        if names:
            table = [rows.get(k, [255] * len(names)) for k in keys]
            w.write(
                "labels",
                np.array(table, dtype=np.uint8).reshape(len(keys), len(names)),
                read="whole",
            )
        w.write(
            "reports_utf8",
            np.frombuffer(blob, dtype=np.uint8) if blob else np.zeros(1, np.uint8),
            read="whole",
        )
        w.write("reports_offsets", offsets, read="whole")
    return dg.MaterializeResult(
        metadata={
            "revision_sha": sha,
            "volumes": len(keys),
            "bytes_to_download": sum(v.size for v in volumes.values()),
            "labelled": sum(k in rows for k in keys),
            "with_report": sum(bool(t) for t in text),
        },
        check_results=[dg.AssetCheckResult(check_name="non_empty", passed=bool(keys))],
    )


@partitioned_asset(
    partitions_def=hub_ct_scans,
    group="hub",
    code_version=VOLUME_VERSION,
    checks=("ctclip_shape", "value_range"),
    deps=(hub_ct_catalog,),
)
def hub_ct_volume(
    context: dg.AssetExecutionContext,
    hf: HuggingFaceResource,
    zarr_store: ZarrStoreResource,
    build: BuildOptions,
) -> dg.MaterializeResult:
    """CT-CLIP-preprocessed volume: HU (CSV rescale unless the file already holds HU),
    1.5×0.75×0.75 mm, [−1000, 1000] → [−1, 1], centre crop/pad to 240×480×480, float16."""
    hub, store = hf.hub(), zarr_store.store()
    catalog = store.commit_record(CATALOG_ASSET, hf.split)["attrs"]
    sha = catalog["revision_sha"]
    files = catalog["files"]  # from the catalog: no listing call, and it works offline
    metadata_csv = hub.table("metadata", sha)
    meta = read_ct_rate_metadata(metadata_csv.parent) if metadata_csv else {}
    preset = ct.CT_CLIP

    def one(key: str) -> Built:
        if key not in files:
            raise dg.Failure(f"{key} is not in the catalog of {hf.repo_id}@{sha} {hf.split}")
        volume = HubVolume(key, *files[key])
        slope, intercept = rescale_from_metadata(meta.get(key))
        params = {**preset.params(), "slope": slope, "intercept": intercept}
        fp = fingerprint(
            VOLUME_VERSION, params, {"sha256": volume.sha256, "path": volume.path, "revision": sha}
        )
        seconds, fresh = None, None
        if not reuse(store, VOLUME_ASSET, key, fp, build.force):
            t0 = time.perf_counter()
            path = hub.download(volume.path, sha)
            vol = read_nifti(path)
            already_hu = ct.is_hu(vol.data)
            out = ct.preprocess(
                ct.to_hu(vol.data, slope, intercept, already_hu), vol.spacing, preset
            )
            fresh = {"image": out}
            attrs = provenance(
                f"hf://datasets/{hf.repo_id}@{sha}/{volume.path}",
                volume.sha256,
                VOLUME_VERSION,
                {**params, "source_in_hu": already_hu},
                fingerprint=fp,
                revision_sha=sha,
                source_spacing_zyx_mm=vol.spacing,
            )
            with store.write_partition(VOLUME_ASSET, key, attrs) as w:
                w.write("image", out, dimension_names=("z", "y", "x"))
            if hf.delete_after_commit:
                hub.forget(path)
            seconds = time.perf_counter() - t0
        out = checked_arrays(store, VOLUME_ASSET, key, fresh)["image"]
        lo, hi, finite = finite_range(out)
        return Built(
            metadata=report(
                store,
                VOLUME_ASSET,
                key,
                seconds,
                revision_sha=sha,
                preview=preview((out[out.shape[0] // 2].astype(np.float32) + 1) / 2),
            ),
            checks={
                "ctclip_shape": (
                    out.shape == preset.shape and out.dtype == np.float16,
                    {"shape": str(out.shape), "dtype": str(out.dtype)},
                ),
                "value_range": (
                    finite and lo >= -1 and hi <= 1,
                    {"min": lo, "max": hi, "finite": finite},
                ),
            },
            data_version=volume.sha256,
        )

    return materialize_partitions(context, one)
