"""The production shape on the machine's Postgres and Redis: an instance in a fresh Postgres
database, code server, webserver and daemon as separate processes, steps on two Celery
workers.  A backfill over 8 CT partitions builds the store the embedded build builds, and a
crash of the runs and workers mid-step no longer blocks the queue."""

import time

import dagster as dg
import pytest
import yaml
from crash import POLL_S, crash_and_recover
from ct_builds import ct_deployment, ct_raw, embedded_build, store_arrays
from services import REPO, instance_yaml, postgres_database, redis_database

pytestmark = pytest.mark.slow
WORKERS = ("w1", "w2")


@pytest.fixture(scope="module")
def celery(tmp_path_factory):
    """(deployment, raw folder, keys): deploy/dagster.yaml with test-sized limits, 11 raw scans
    (8 backfilled, 2 crashed, 1 to measure the machine before the crash), a fresh Postgres
    database, a Redis database of its own, two workers."""
    tmp = tmp_path_factory.mktemp("celery")
    raw = ct_raw(tmp / "raw", 11)
    production = yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())
    limits = {"max_concurrent_runs": 2, "poll_interval_seconds": POLL_S,
              "free_slots_after_run_end_seconds": 1}  # fmt: skip
    with postgres_database() as pg, redis_database() as broker:
        env = {**pg, **broker, "ZARRFEED_EXECUTOR": "celery"}
        config = instance_yaml(production, **limits)
        with ct_deployment(tmp, raw, config, env, WORKERS) as (d, keys):
            d.set_pool_limit("zarrfeed_io", 2)  # as deploy/README.md has it, at test scale
            yield d, raw, keys


def test_backfill_on_two_celery_workers_builds_the_embedded_store(celery, tmp_path):
    """Two backfills of 4 partitions each: batched, each is one run over its range (the
    family's backfill policy), and the two runs' steps share the two workers."""
    from zarrfeed.assets.build import BATCH

    d, raw, keys = celery
    backfilled = keys[:8]
    halves = [backfilled[:4], backfilled[4:]]
    per_run = BATCH.max_partitions_per_run
    expected = [-(-len(half) // per_run) for half in halves]  # runs a backfill makes
    t0 = time.perf_counter()
    backfills = [d.launch_backfill("ct_build", half, {}) for half in halves]
    embedded = str(tmp_path / "embedded.zarr")
    embedded_build(raw, embedded, tmp_path / "embedded_home", {}, backfilled)
    runs = [r for b, n in zip(backfills, expected, strict=True) for r in d.wait_backfill(b, n)]
    seconds = time.perf_counter() - t0
    with d.instance() as instance:
        workers = set()
        for run in runs:
            assert run.is_success, (run.tags, run.status)
            stats = instance.get_run_stats(run.run_id)
            assert stats.steps_failed == 0 and stats.steps_succeeded == 3
            for record in instance.get_records_for_run(
                run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT
            ).records:
                meta = record.event_log_entry.dagster_event.engine_event_data.metadata
                if "Celery worker" in meta:
                    workers.add(meta["Celery worker"].value.split("@")[0])
            if len(halves[0]) > 1:  # a range run, not a run per partition
                assert "dagster/asset_partition_range_start" in run.tags, run.tags
        for key in backfilled:
            [event] = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey("ct_windows"), asset_partitions=[key]),
                limit=1,
            ).records
            assert event.partition_key == key  # recorded per partition, not per range
    assert workers == set(WORKERS)  # the steps ran on both worker processes
    ours, theirs = store_arrays(d.env["ZARRFEED_STORE"]), store_arrays(embedded)
    assert {k[1] for k in ours} == set(backfilled) and ours == theirs
    print(f"8-partition backfill in {len(runs)} runs on 2 Celery workers: {seconds:.0f}s")


def test_crashed_runs_and_workers_do_not_block_the_queue(celery):
    d, raw, keys = celery
    victims = {k: next(raw.rglob(f"{k}.nii.gz")) for k in keys[8:10]}
    seconds = crash_and_recover(d, victims, {}, measure=keys[10], workers=WORKERS)
    print(f"crashed runs failed {seconds}")
