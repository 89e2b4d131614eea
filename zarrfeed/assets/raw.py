"""Raw-ingest assets, one per family: a raw item's content hash (its data version) and facts.

A partition run looks its item up in the catalog (one small read) — never the raw tree — and
runs one partition per run: Dagster 1.13 keeps one data version per step, and this per-item
hash is what makes exactly the changed item's partitions stale.  Two raw items that claim one
key fail their partition, naming both; a partition whose source is gone fails in one line
that says how to remove it.
"""

import dagster as dg

from zarrfeed.assets.build import IO_POOL, OWNERS, intended
from zarrfeed.assets.partitions import partitions_def
from zarrfeed.families import Family, Inputs
from zarrfeed.resources import ZarrStoreResource
from zarrfeed.sources.raw import is_hub, source_version


def raw_asset(family: Family) -> dg.AssetsDefinition:
    """The raw-ingest asset of ``family``, from its ``RawSource`` declaration."""
    raw, partitions = family.raw, partitions_def(family)
    with intended():  # partitioned like the asset: the UI shows each partition's result
        readable = dg.AssetCheckSpec(
            raw.readable.name,
            asset=raw.asset,
            blocking=True,
            description=raw.readable.description,
            partitions_def=partitions,
        )

    @dg.asset(
        name=raw.asset,
        partitions_def=partitions,
        group_name=family.name,
        code_version=raw.version,
        description=raw.description,
        kinds=set(raw.kinds),
        owners=OWNERS,
        tags={"family": family.name, "stage": "raw"},
        pool=IO_POOL,
        check_specs=[readable],
    )
    def _raw(
        context: dg.AssetExecutionContext, zarr_store: ZarrStoreResource
    ) -> dg.MaterializeResult:
        inputs = Inputs(family, zarr_store.store(), zarr_store.catalog(family.name), {})
        item = inputs.item(context.partition_key)
        sha = inputs.content_hash(item)
        metadata, readable, facts = raw.describe(item)
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
                dg.AssetCheckResult(check_name=raw.readable.name, passed=readable, metadata=facts)
            ],
        )

    return _raw
