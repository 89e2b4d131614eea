"""One dataset manifest per family (unpartitioned): the complete, checked samples training
consumes — declared in ``zarrfeed.store.contract`` as ``DATASETS``.

A manifest's data version is a digest of its keys, the committed version of each of their
partitions and its extra tables, so it changes exactly when what training would read does;
manifests refresh, and models retrain, only on a changed data version
(:data:`zarrfeed.assets.conditions.ON_NEW_DATA`), never because a run reused every partition.
"""

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import dagster as dg
import numpy as np

from zarrfeed.assets.build import OWNERS
from zarrfeed.assets.conditions import ON_NEW_DATA
from zarrfeed.assets.hub import UNKNOWN_LABEL, hub_labels
from zarrfeed.assets.metadata import mib, table
from zarrfeed.formats.discover import read_ct_rate_labels
from zarrfeed.resources import RawFolderResource, ZarrStoreResource
from zarrfeed.store import ZarrStore
from zarrfeed.store.contract import DATASETS, FAMILIES, Dataset

# The nightly schedules rebuild what is missing or stale; a manifest older than two days means
# they have stopped.
FRESHNESS = dg.FreshnessPolicy.time_window(
    fail_window=timedelta(hours=48), warn_window=timedelta(hours=26)
)


def ct_labels(store: ZarrStore, raw: RawFolderResource, keys: list[str]) -> dict:
    """CT-RATE labels aligned with the keys (raw-folder CSVs, then hub splits)."""
    names, rows = read_ct_rate_labels(raw.root)
    hub_names, hub_rows = hub_labels(store)
    if hub_names and names and hub_names != names:
        raise dg.Failure(f"label columns of the hub {hub_names} differ from {raw.root}'s {names}")
    names, rows = names or hub_names, {**hub_rows, **rows}
    if not names:
        return {}
    unknown = [UNKNOWN_LABEL] * len(names)
    table = np.array([rows.get(k, unknown) for k in keys], dtype=np.uint8)
    attrs = {"names": names, "keys": keys, "unknown": UNKNOWN_LABEL}
    with store.write_partition(DATASETS["ct"].path, "labels", attrs) as w:
        w.write("labels", table.reshape(len(keys), len(names)), read="whole")
    digest = hashlib.sha256(table.tobytes() + json.dumps(names).encode()).hexdigest()
    return {"labelled": sum(k in rows for k in keys), "labels_sha256": digest[:16]}


EXTRA: dict[str, Callable[[ZarrStore, RawFolderResource, list[str]], dict]] = {"ct": ct_labels}


def data_version(manifest: dict[str, Any], extra: dict[str, Any]) -> str:
    """What training would read: every key's committed partition version in every asset,
    and the extra tables' facts."""
    versions = {
        asset: [[p["key"], p["version"]] for p in m["partitions"]]
        for asset, m in manifest["assets"].items()
    }
    blob = json.dumps([manifest["keys"], versions, extra], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def conflicts(zarr_store: ZarrStoreResource, ds: Dataset) -> dict[str, list[str]]:
    """Key → why, for the keys two or more raw items now claim: their committed partitions
    were built from one of them, and which one training should read is undecided until the
    user renames one (``zarrfeed status`` lists them)."""
    family = next(f.name for f in FAMILIES.values() if f.dataset.name == ds.name)
    return {
        key: [f"conflict: {item.location} and {', '.join(item.conflict)} claim this key"]
        for key, item in zarr_store.catalog(family).index().items()
        if item.conflict
    }


def dataset_asset(ds: Dataset, deps: list[str]) -> dg.AssetsDefinition:
    name = f"{ds.name}_dataset"

    def spec(check: str, text: str, blocking: bool = True) -> dg.AssetCheckSpec:
        return dg.AssetCheckSpec(check, asset=name, blocking=blocking, description=text)

    @dg.asset(
        name=name,
        deps=deps,
        group_name="datasets",
        code_version="2",
        description=f"The {ds.name} dataset training reads: the keys complete in "
        f"{', '.join(a.name for a in ds.assets)} whose partitions passed every blocking "
        "check, with consolidated index tables.",
        kinds={"zarr", "json"},
        owners=OWNERS,
        tags={"family": ds.name, "stage": "dataset"},
        automation_condition=ON_NEW_DATA,
        freshness_policy=FRESHNESS,
        check_specs=[
            spec("non_empty", "At least one complete sample."),
            spec("uniform_dtypes", "Every array has one dtype across partitions."),
            spec(
                "all_partitions_complete",
                "No partition is incomplete or failed its checks (a warning: the others train).",
                blocking=False,
            ),
        ],
    )
    def _dataset(zarr_store: ZarrStoreResource, raw: RawFolderResource) -> dg.MaterializeResult:
        store = zarr_store.store()
        manifest = store.write_dataset(
            ds.name, [a.path for a in ds.assets], conflicts(zarr_store, ds)
        )
        keys = manifest["keys"]
        pinned = {a: [p["version"] for p in m["partitions"]] for a, m in manifest["assets"].items()}
        consolidated = {
            table: store.consolidate(ds.name, spec.path, keys, list(arrays), pinned[spec.path])
            for table, (spec, arrays) in ds.tables.items()
            if keys
        }
        if keys and ds.name in EXTRA:
            consolidated |= EXTRA[ds.name](store, raw, keys)
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
            data_version=dg.DataVersion(data_version(manifest, consolidated)),
            metadata={
                "dagster/uri": dg.MetadataValue.path(
                    f"{store.url}/.zarrfeed/manifests/{ds.name}.json"
                ),
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


dataset_assets = [
    dataset_asset(DATASETS["ct"], ["ct_hu", "ct_windows", "ct_sparse", "ct_patches"]),
    dataset_asset(DATASETS["spike"], ["spike_voxels", "spike_frames"]),
    dataset_asset(DATASETS["image"], ["image_store", "image_patches"]),
]
ct_dataset, spike_dataset, image_dataset = dataset_assets
