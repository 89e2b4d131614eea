"""One dataset manifest per family (unpartitioned): the complete, checked samples training
consumes, with the tables the family declares.

A manifest's data version is its dataset version's id (:mod:`zarrfeed.datasets.snapshots`),
which carries a digest of its keys, the version of each of their partitions and its tables,
so it changes exactly when what training would read does; manifests refresh, and models
retrain, only on a changed data version (:data:`zarrfeed.assets.conditions.ON_NEW_DATA`),
never because a run reused every partition.  A model reads the version whose id Dagster
recorded, so its lineage names exactly the data it read.
"""

import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import dagster as dg

from zarrfeed.assets.build import OWNERS
from zarrfeed.assets.conditions import ON_NEW_DATA
from zarrfeed.assets.metadata import mib, table
from zarrfeed.datasets import consolidate, manifest_url, plan_dataset, publish_dataset
from zarrfeed.families import Family
from zarrfeed.resources import RawFolderResource, ZarrStoreResource
from zarrfeed.sources.catalog import RawCatalog, RawItem
from zarrfeed.sources.duplicates import duplicates
from zarrfeed.store import ZarrStore
from zarrfeed.store.contract import SOURCE

# The nightly schedules rebuild what is missing or stale; a manifest older than two days means
# they have stopped.
FRESHNESS = dg.FreshnessPolicy.time_window(
    fail_window=timedelta(hours=48), warn_window=timedelta(hours=26)
)


def conflicts(index: Mapping[str, RawItem]) -> dict[str, list[str]]:
    """Key → why, for the keys two or more raw items now claim: their committed partitions
    were built from one of them, and which one training should read is undecided until the
    user renames one (``zarrfeed status`` lists them)."""
    return {
        key: [f"conflict: {item.location} and {', '.join(item.conflict)} claim this key"]
        for key, item in index.items()
        if item.conflict
    }


def withheld(store: ZarrStore, catalog: RawCatalog, family: Family) -> dict[str, list[str]]:
    """Key → why, for committed keys the manifest leaves out although their data is sound:
    conflicts, and duplicates of another key's raw content (a renamed or copied file,
    :func:`~zarrfeed.sources.duplicates.duplicates`), found from the catalog index and the
    first stage's record summaries, both incremental."""
    index = catalog.index()
    held = conflicts(index)
    head = next(a for a in family.assets if SOURCE in a.inputs)
    return held | duplicates(family.name, store.record_summaries(head.path), index, skip=held)


def dataset_asset(family: Family, settings: Mapping[str, Any] | None = None) -> dg.AssetsDefinition:
    """The manifest asset of ``family``: its keys complete in every stage, its tables.
    ``settings``: the family's settings values (default: its defaults), whose values of the
    settings readers take per dataset win over other builds'."""
    values = family.values(settings)
    name = family.dataset_asset

    def spec(check: str, text: str, blocking: bool = True) -> dg.AssetCheckSpec:
        return dg.AssetCheckSpec(check, asset=name, blocking=blocking, description=text)

    @dg.asset(
        name=name,
        deps=[a.name for a in family.assets],
        group_name="datasets",
        code_version=family.dataset_version,
        description=f"The {family.name} dataset training reads: the keys complete in "
        f"{', '.join(a.name for a in family.assets)} whose partitions passed every blocking "
        "check, with consolidated index tables.",
        kinds={"zarr", "json"},
        owners=OWNERS,
        tags={"family": family.name, "stage": "dataset"},
        automation_condition=ON_NEW_DATA,
        freshness_policy=FRESHNESS,
        check_specs=[
            spec("non_empty", "At least one complete sample."),
            spec("uniform_dtypes", "Every array has one dtype across partitions."),
            spec(
                "all_partitions_complete",
                "No partition is incomplete, failed its checks, or is withheld (a conflict, a "
                "duplicate of another key's raw content): a warning, the others train.",
                blocking=False,
            ),
        ],
    )
    def _dataset(zarr_store: ZarrStoreResource, raw: RawFolderResource) -> dg.MaterializeResult:
        store = zarr_store.store()
        paths = [a.path for a in family.assets]
        held = withheld(store, zarr_store.catalog(family.name), family)
        plan = plan_dataset(store, family.name, paths, held, family.assets, values)
        keys = plan.keys
        consolidated: dict[str, Any] = {
            t.name: consolidate(
                store,
                family.name,
                t.asset.path,
                keys,
                list(t.arrays),
                plan.versions(t.asset.path),
                table=t.name,
            )
            for t in family.tables
            if keys
        }
        for extra in family.extras if keys else ():
            consolidated[extra.name] = extra.write(store, raw.root, keys, family.dataset_path)
        manifest = publish_dataset(store, plan, consolidated, zarr_store.retention())
        mixed = {
            f"{a}/{n}": arr["dtypes"]
            for a, m in manifest["assets"].items()
            for n, arr in m["arrays"].items()
            if len(arr["dtypes"]) > 1
        }
        per_asset = manifest["assets"].values()
        stored = sum(m["total_stored_bytes"] for m in per_asset)
        nbytes = sum(m["total_nbytes"] for m in per_asset)
        left_out = {**{k: ["incomplete"] for k in manifest["incomplete"]}, **manifest["failed"]}
        arrays = [
            [a, n, ", ".join(arr["dtypes"]), len(arr["shapes"]), mib(arr["nbytes"])]
            for a, m in manifest["assets"].items()
            for n, arr in m["arrays"].items()
        ]
        return dg.MaterializeResult(
            data_version=dg.DataVersion(manifest["id"]),
            metadata={
                "dagster/uri": dg.MetadataValue.path(manifest_url(store, family.name)),
                "dataset_version": manifest["id"],
                "dagster/row_count": len(keys),
                "left_out": table(["key", "why"], [[k, ", ".join(v)] for k, v in left_out.items()])
                if left_out
                else "none",
                "stored_MiB": mib(stored),
                "raw_MiB": mib(nbytes),
                "compression_ratio": round(nbytes / stored, 2) if stored else 0.0,
                "arrays": table(["asset", "array", "dtypes", "shapes", "MiB"], arrays),
                "consolidated": table(
                    ["table", "facts"],
                    [
                        [t, json.dumps(v) if isinstance(v, dict) else str(v)]
                        for t, v in consolidated.items()
                    ],
                ),
            },
            check_results=[
                dg.AssetCheckResult(check_name="non_empty", passed=bool(keys)),
                dg.AssetCheckResult(
                    check_name="uniform_dtypes", passed=not mixed, metadata={"mixed": mixed}
                ),
                dg.AssetCheckResult(
                    check_name="all_partitions_complete",
                    passed=not left_out,
                    severity=dg.AssetCheckSeverity.WARN,  # a failed scan must not block training
                    metadata={"left_out": dg.MetadataValue.json(left_out)},
                ),
            ],
        )

    return _dataset
