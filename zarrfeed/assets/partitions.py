"""Partition definitions: one dynamic partition per raw item, added by discovery."""

import dagster as dg

from zarrfeed.store.contract import FAMILIES

PARTITIONS = {
    name: dg.DynamicPartitionsDefinition(name=family.partitions)
    for name, family in FAMILIES.items()
}
ct_scans, spike_sequences, image_sets = PARTITIONS["ct"], PARTITIONS["spike"], PARTITIONS["images"]
