"""Partition definitions: one dynamic partition per raw item, added by the discovery sensors."""

import dagster as dg

ct_scans = dg.DynamicPartitionsDefinition(name="ct_scans")
spike_sequences = dg.DynamicPartitionsDefinition(name="spike_sequences")
image_sets = dg.DynamicPartitionsDefinition(name="image_sets")
hub_ct_scans = dg.DynamicPartitionsDefinition(name="hub_ct_scans")
