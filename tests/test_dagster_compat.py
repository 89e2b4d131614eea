"""``zarrfeed.assets.compat`` holds what Dagster 1.13 offers no public way for; these tests
fail the day Dagster changes it: the provenance tags a batched step writes are the ones
Dagster writes for a one-partition run, and a batched step's marked result records no
event of its own while the next step of the run still runs."""

import warnings

import dagster as dg

from zarrfeed.assets.compat import (
    DATA_VERSION_TAG,
    LOGGED_BY_STEP,
    data_version_of,
    input_pointer_tag,
    input_version_tag,
    provenance_tags,
)

PARTS = dg.StaticPartitionsDefinition(["a", "b"])
RANGE = {"dagster/asset_partition_range_start": "a", "dagster/asset_partition_range_end": "b"}


@dg.asset(partitions_def=PARTS)
def up(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    return dg.MaterializeResult(data_version=dg.DataVersion(f"up-{context.partition_key}"))


@dg.asset(partitions_def=PARTS, deps=[up], code_version="7")
def down(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    return dg.MaterializeResult(data_version=dg.DataVersion(f"down-{context.partition_key}"))


def batched(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """Logs each partition of its range itself, as ``zarrfeed.assets.events`` does."""
    for key in context.partition_keys:
        tags = provenance_tags(f"batch-{key}", "7", {})
        context.log_event(dg.AssetMaterialization("batch", partition=key, tags=tags))
    return dg.MaterializeResult(metadata={LOGGED_BY_STEP: True})


def latest(instance: dg.DagsterInstance, key: str, partition: str) -> dg.EventLogRecord:
    [record] = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=[partition]), limit=1
    ).records
    return record


def test_the_provenance_tags_are_those_dagster_writes_for_a_one_partition_run():
    with dg.instance_for_test() as instance:
        assert dg.materialize([up], partition_key="a", instance=instance).success
        assert dg.materialize([up, down], partition_key="a", instance=instance).success
        record = latest(instance, "down", "a")
        read = latest(instance, "up", "a")
        want = provenance_tags("down-a", "7", {dg.AssetKey("up"): ("up-a", read.storage_id)})
        tags = record.event_log_entry.tags
        assert set(tags) == set(want)
        # The input tags' values are Dagster's own (a digest of the upstream partitions'
        # versions, the storage id its staleness reads after): a batched step writes the
        # partition's version and its event's storage id, which staleness reads the same way.
        inputs = {input_version_tag(up.key), input_pointer_tag(up.key)}
        assert {k: v for k, v in tags.items() if k not in inputs} == {
            k: v for k, v in want.items() if k not in inputs
        }
        assert data_version_of(record.event_log_entry.tags) == "down-a"
        version = instance.get_latest_data_version_record(dg.AssetKey("down"), partition_key="a")
        assert version is not None and version.storage_id == record.storage_id


def test_a_marked_batched_result_records_no_event_and_the_next_step_runs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)  # backfill_policy=
        batch = dg.asset(
            name="batch", partitions_def=PARTS, backfill_policy=dg.BackfillPolicy.single_run()
        )(batched)

        @dg.asset(
            partitions_def=PARTS, deps=[batch], backfill_policy=dg.BackfillPolicy.single_run()
        )
        def after(context: dg.AssetExecutionContext) -> None:
            pass

    with dg.instance_for_test() as instance:
        result = dg.materialize([batch, after], instance=instance, tags=RANGE)
        assert result.success
        events = [e.materialization for e in result.get_asset_materialization_events()]
        mine = [(m.partition, m.tags[DATA_VERSION_TAG]) for m in events if m.asset_key == batch.key]
        assert sorted(mine) == [("a", "batch-a"), ("b", "batch-b")]
        assert sorted(m.partition for m in events if m.asset_key == after.key) == ["a", "b"]
        for key in ["a", "b"]:
            record = instance.get_latest_data_version_record(batch.key, partition_key=key)
            assert data_version_of(record.event_log_entry.tags) == f"batch-{key}"
