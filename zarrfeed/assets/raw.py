"""Raw-ingest assets, one per family: a raw item's content hash (its data version) and facts.

A partition run looks its item up in the catalog (one small read) — never the raw tree.  A
batched run hashes its items side by side and records each item's hash as that partition's
data version (``zarrfeed.assets.events``): exactly the changed item's partitions go stale.
Two raw items that claim one key fail their partition, naming both; a partition whose source
is gone fails in one line that says how to remove it.
"""

from collections.abc import Iterator, Sequence

import dagster as dg

from zarrfeed.assets.build import (
    BATCH,
    IO_POOL,
    OWNERS,
    Built,
    intended,
    materialize_partitions,
    warm_workers,
)
from zarrfeed.assets.partitions import partitions_def
from zarrfeed.families import Family, Inputs
from zarrfeed.resources import ZarrStoreResource
from zarrfeed.sources.catalog import RawCatalog
from zarrfeed.sources.raw import is_hub, source_version

HASH_BUFFER = 64 << 20  # what hashing one raw item holds at once, generously


def raw_asset(family: Family) -> dg.AssetsDefinition:
    """The raw-ingest asset of ``family``, from its ``RawSource`` declaration."""
    raw, partitions = family.raw, partitions_def(family)
    with intended():  # a check partitioned like its asset, a backfill policy
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
            backfill_policy=BATCH,
            check_specs=[readable],
        )
        def _raw(
            context: dg.AssetExecutionContext, zarr_store: ZarrStoreResource
        ) -> Iterator[dg.MaterializeResult]:
            catalog = zarr_store.catalog(family.name)
            inputs = Inputs(family, zarr_store.store(), catalog, {})
            key = dg.AssetKey(raw.asset)

            def one(partition: str) -> Iterator[tuple[dg.AssetKey, Built]]:
                item = inputs.item(partition)
                sha = inputs.content_hash(item)
                metadata, passed, facts = raw.describe(item)
                location = (
                    dg.MetadataValue.url(item.location)
                    if is_hub(item)
                    else dg.MetadataValue.path(item.location)
                )
                facts_of = {"kind": item.kind, "sha256": sha, "bytes": item.size, **metadata}
                checks = {raw.readable.name: (passed, facts)}
                built = Built({"location": location, **facts_of}, checks, source_version(item, sha))
                yield key, built

            if family.stages:
                warm_workers(context, item_bytes(family, catalog, context.partition_keys))
            # Hashing streams the files: an item holds a read buffer, not its decoded arrays.
            yield from materialize_partitions(context, [key], one, lambda: HASH_BUFFER)

    return _raw


def item_bytes(family: Family, catalog: RawCatalog, keys: Sequence[str]) -> int:
    """Working memory building one of ``keys`` takes at most: the largest raw item's size
    times its family's :attr:`~zarrfeed.families.RawSource.memory_per_byte` (keys without a
    catalog entry fail on their own when built)."""
    index = catalog.index()
    largest = max((index[k].size for k in keys if k in index), default=0)
    return int(largest * family.raw.memory_per_byte)
