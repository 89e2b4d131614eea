"""Partition definitions: one dynamic partition per raw item, added by the discovery sensor."""

import dagster as dg

ct_scans = dg.DynamicPartitionsDefinition(name="ct_scans")
