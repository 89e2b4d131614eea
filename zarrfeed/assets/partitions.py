"""Partition definitions: one dynamic partition per raw item of a family, added by
discovery."""

import dagster as dg

from zarrfeed.families import Family


def partitions_def(family: Family) -> dg.DynamicPartitionsDefinition:
    """The family's partitions (equal definitions for equal names, so each asset, check,
    sensor and schedule of the family may make its own)."""
    return dg.DynamicPartitionsDefinition(name=family.partitions)
