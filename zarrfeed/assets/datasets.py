"""One dataset manifest per family (unpartitioned): the complete samples training consumes."""

from collections.abc import Callable
from datetime import timedelta

import dagster as dg
import numpy as np

from zarrfeed.assets.ct import CT_STORE_ASSETS, PATCHES_ASSET, ct_derived
from zarrfeed.assets.images import (
    IMAGE_PATCHES_ASSET,
    IMAGE_STORE_ASSETS,
    image_patches,
    image_store,
)
from zarrfeed.assets.spike import SPIKE_STORE_ASSETS, spike_frames, spike_voxels
from zarrfeed.resources import RawFolderResource, ZarrStoreResource
from zarrfeed.store import ZarrStore

UNKNOWN_LABEL = 255  # a scan with no row in the label CSVs

# Refresh whenever any upstream partition was updated and nothing upstream is running.  Not
# eager(): that waits while any upstream partition is missing, and a newly discovered scan is
# missing until it is built (shared/notes/dagster.md §2).
ON_ANY_PARTITION_UPDATE = (
    dg.AutomationCondition.any_deps_updated().since_last_handled()
    & ~dg.AutomationCondition.any_deps_in_progress()
    & ~dg.AutomationCondition.in_progress()
).with_label("on_any_partition_update")

# The nightly schedules rebuild what is missing or stale; a manifest older than two days means
# they have stopped.
FRESHNESS = dg.FreshnessPolicy.time_window(
    fail_window=timedelta(hours=48), warn_window=timedelta(hours=26)
)


def ct_tables(store: ZarrStore, raw: RawFolderResource, keys: list[str]) -> dict:
    """The patch index over all scans, and the CT-RATE labels aligned with the keys."""
    out = {"patches": store.consolidate("ct", PATCHES_ASSET, keys, ["origins", "fraction"])}
    names, rows = raw.ct_labels()
    if names:
        unknown = [UNKNOWN_LABEL] * len(names)
        table = np.array([rows.get(k, unknown) for k in keys], dtype=np.uint8)
        attrs = {"names": names, "keys": keys, "unknown": UNKNOWN_LABEL}
        with store.write_partition("datasets/ct", "labels", attrs) as w:
            w.write("labels", table.reshape(len(keys), len(names)), read="whole")
        out["labelled"] = sum(k in rows for k in keys)
    return out


def image_tables(store: ZarrStore, raw: RawFolderResource, keys: list[str]) -> dict:
    return {"patches": store.consolidate("image", IMAGE_PATCHES_ASSET, keys, ["items", "origins"])}


def dataset_asset(
    name: str,
    deps: list,
    store_assets: tuple[str, ...],
    tables: Callable[[ZarrStore, RawFolderResource, list[str]], dict] | None = None,
) -> dg.AssetsDefinition:
    @dg.asset(
        name=f"{name}_dataset",
        deps=deps,
        group_name="datasets",
        code_version="1",
        automation_condition=ON_ANY_PARTITION_UPDATE,
        freshness_policy=FRESHNESS,
        check_specs=[
            dg.AssetCheckSpec("non_empty", asset=f"{name}_dataset", blocking=True),
            dg.AssetCheckSpec("uniform_dtypes", asset=f"{name}_dataset", blocking=True),
            dg.AssetCheckSpec("all_partitions_complete", asset=f"{name}_dataset"),
        ],
    )
    def _dataset(zarr_store: ZarrStoreResource, raw: RawFolderResource) -> dg.MaterializeResult:
        store = zarr_store.store()
        manifest = store.write_dataset(name, list(store_assets))
        consolidated = tables(store, raw, manifest["keys"]) if tables and manifest["keys"] else {}
        mixed = {f"{a}/{n}": arr["dtypes"] for a, m in manifest["assets"].items()
                 for n, arr in m["arrays"].items() if len(arr["dtypes"]) > 1}  # fmt: skip
        per_asset = manifest["assets"].values()
        stored = sum(m["total_stored_bytes"] for m in per_asset)
        nbytes = sum(m["total_nbytes"] for m in per_asset)
        return dg.MaterializeResult(
            metadata={
                "dagster/uri": dg.MetadataValue.path(
                    f"{store.url}/.zarrfeed/manifests/{name}.json"
                ),
                "samples": len(manifest["keys"]),
                "consolidated": dg.MetadataValue.json(consolidated),
                "incomplete": dg.MetadataValue.json(manifest["incomplete"]),
                "stored_bytes": stored,
                "raw_bytes": nbytes,
                "compression_ratio": round(nbytes / stored, 3) if stored else 0.0,
                "arrays": dg.MetadataValue.json(
                    {a: m["arrays"] for a, m in manifest["assets"].items()}
                ),
            },
            check_results=[
                dg.AssetCheckResult(check_name="non_empty", passed=bool(manifest["keys"])),
                dg.AssetCheckResult(
                    check_name="uniform_dtypes", passed=not mixed, metadata={"mixed": mixed}
                ),
                dg.AssetCheckResult(
                    check_name="all_partitions_complete",
                    passed=not manifest["incomplete"],
                    severity=dg.AssetCheckSeverity.WARN,  # a failed scan must not block training
                    metadata={"incomplete": manifest["incomplete"]},
                ),
            ],
        )

    return _dataset


ct_dataset = dataset_asset("ct", [ct_derived], CT_STORE_ASSETS, ct_tables)
spike_dataset = dataset_asset("spike", [spike_voxels, spike_frames], SPIKE_STORE_ASSETS)
image_dataset = dataset_asset(
    "image", [image_store, image_patches], IMAGE_STORE_ASSETS, image_tables
)
