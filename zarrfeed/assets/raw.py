"""Raw-ingest assets, one per family: a raw item's content hash (its data version) and facts.

A partition run looks its item up in the catalog (one small read) — never the raw tree — and
runs one partition per run: Dagster 1.13 keeps one data version per step, and this per-item
hash is what makes exactly the changed item's partitions stale.  Two raw items that claim one
key fail their partition, naming both; a partition whose source is gone fails in one line
that says how to remove it.
"""

from collections.abc import Callable
from typing import Any

import dagster as dg

from zarrfeed.assets.build import IO_POOL, OWNERS
from zarrfeed.assets.checks import CHECK_DOCS
from zarrfeed.assets.partitions import PARTITIONS
from zarrfeed.errors import InputError, ZarrfeedError
from zarrfeed.resources import ZarrStoreResource
from zarrfeed.sources.catalog import RawCatalog, RawItem
from zarrfeed.sources.raw import is_hub, item_sha256, source_version
from zarrfeed.store.contract import Family

# item → (metadata, readable?, facts for the check)
Describe = Callable[[RawItem], tuple[dict[str, Any], bool, dict[str, Any]]]
RAW_VERSION = "2"
KINDS = {"ct": {"nifti", "dicom", "numpy"}, "spike": {"numpy"}, "images": {"png", "tiff"}}


def resolve(catalog: RawCatalog, key: str) -> RawItem:
    """The catalog entry of partition ``key``; one-line failures for a missing source or a
    key that two raw items claim."""
    try:
        item = catalog.require(key)
    except ZarrfeedError as exc:
        raise dg.Failure(str(exc)) from None
    if item.conflict:
        raise InputError(
            item.location,
            f"a raw item of its own for partition key {key!r}",
            "the same key for " + ", ".join(item.conflict) + " (rename one of them)",
        )
    return item


def content_hash(catalog: RawCatalog, item: RawItem) -> str:
    """The item's content hash: recorded (hub listings, an earlier ingest of the same bytes)
    or computed now and recorded."""
    if item.content_hash:
        return item.content_hash
    if is_hub(item):
        raise dg.Failure(f"{item.location}: the hub listing gave no LFS hash for this file")
    return catalog.record_hash(item, item_sha256(item)).sha256 or ""


def raw_asset(family: Family, describe: Describe, description: str) -> dg.AssetsDefinition:
    @dg.asset(
        name=family.raw_asset,
        partitions_def=PARTITIONS[family.name],
        group_name=family.name,
        code_version=RAW_VERSION,
        description=description,
        kinds=KINDS[family.name],
        owners=OWNERS,
        tags={"family": family.name, "stage": "raw"},
        pool=IO_POOL,
        check_specs=[
            dg.AssetCheckSpec(
                "readable",
                asset=family.raw_asset,
                blocking=True,
                description=CHECK_DOCS["readable"],
                partitions_def=PARTITIONS[family.name],
            )
        ],
    )
    def _raw(
        context: dg.AssetExecutionContext, zarr_store: ZarrStoreResource
    ) -> dg.MaterializeResult:
        catalog = zarr_store.catalog(family.name)
        item = resolve(catalog, context.partition_key)
        sha = content_hash(catalog, item)
        metadata, readable, facts = describe(item)
        return dg.MaterializeResult(
            data_version=dg.DataVersion(source_version(item, sha)),
            metadata={
                "location": dg.MetadataValue.url(item.location)
                if is_hub(item)
                else dg.MetadataValue.path(item.location),
                "kind": item.kind,
                "sha256": sha,
                "bytes": item.size,
                **metadata,
            },
            check_results=[
                dg.AssetCheckResult(check_name="readable", passed=readable, metadata=facts)
            ],
        )

    return _raw
