"""One dataset manifest per family (unpartitioned): the complete samples training consumes."""

from datetime import timedelta

import dagster as dg

from zarrfeed.assets.ct import CT_STORE_ASSETS, ct_patches, ct_sparse, ct_windows
from zarrfeed.assets.images import IMAGE_STORE_ASSETS, image_patches, image_store
from zarrfeed.assets.spike import SPIKE_STORE_ASSETS, spike_frames, spike_voxels
from zarrfeed.resources import ZarrStoreResource

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


def dataset_asset(name: str, deps: list, store_assets: tuple[str, ...]) -> dg.AssetsDefinition:
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
    def _dataset(zarr_store: ZarrStoreResource) -> dg.MaterializeResult:
        store = zarr_store.store()
        manifest = store.write_dataset(name, list(store_assets))
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


ct_dataset = dataset_asset("ct", [ct_windows, ct_sparse, ct_patches], CT_STORE_ASSETS)
spike_dataset = dataset_asset("spike", [spike_voxels, spike_frames], SPIKE_STORE_ASSETS)
image_dataset = dataset_asset("image", [image_store, image_patches], IMAGE_STORE_ASSETS)
