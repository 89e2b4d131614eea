"""Nightly schedules: rebuild exactly the partitions that are missing or out of date.

Out of date has one meaning, the data contract's (``zarrfeed.store.contract.stale_reason``):
the committed fingerprint differs from the one the current code, settings and inputs give.
The evaluation reads the family's catalog index once and the commit-record summaries of each
stored asset (``ZarrStore.record_summaries``: one listing, then only the records that changed
since the last evaluation) — no raw file is read or hashed — so it stays cheap at tens of
thousands of partitions, also on an object store.
"""

from collections.abc import Mapping
from typing import Any

import dagster as dg

from zarrfeed.assets.build import OWNERS
from zarrfeed.assets.partitions import PARTITIONS
from zarrfeed.jobs.queue import PER_TICK, BuildQueue
from zarrfeed.resources import CTSettings, ImageSettings, SpikeSettings, ZarrStoreResource
from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import source_identity
from zarrfeed.store import ZarrStore
from zarrfeed.store.bulk import gc_paused
from zarrfeed.store.contract import FAMILIES, SOURCE, Family, stale_reason

NIGHTLY_CRON = "0 2 * * *"


def out_of_date(
    family: Family,
    store: ZarrStore,
    settings: Mapping[str, Any],
    keys: list[str],
    index: Mapping[str, RawItem],
) -> dict[str, str]:
    """Partition key → why it needs a build, for every key of ``keys`` that does."""
    records = {spec.name: store.record_summaries(spec.path) for spec in family.assets}
    first = [s for s in family.assets if SOURCE in s.inputs]
    reasons = {}
    for key in keys:
        item = index.get(key)
        if item is None or item.conflict:
            continue  # no source, or one of two: the discovery sensor reports those
        head = records[first[0].name].get(key)
        if head is None:
            reasons[key] = f"{first[0].name} missing"
            continue
        if any(
            (records[s.name].get(key) or {}).get("attrs", {}).get("source_stamp") != item.stamp
            for s in first
        ):
            reasons[key] = "raw item changed"
            continue
        source = source_identity(item, head["attrs"]["source_sha256"])
        expected = family.expected(settings, key, source)
        for spec in family.assets:
            why = stale_reason(records[spec.name].get(key), expected[spec.name])
            if why:
                reasons[key] = f"{spec.name}: {why}"
                break
    return reasons


def nightly_schedule(family: str, job) -> dg.ScheduleDefinition:
    declared, partitions = FAMILIES[family], PARTITIONS[family]

    @dg.schedule(
        name=f"{family}_nightly",
        cron_schedule=NIGHTLY_CRON,
        job=job,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=f"Rebuilds the {family} partitions that are missing or out of date "
        "(changed source, settings or code).",
        tags={"family": family, "stage": "build"},
        owners=OWNERS,
    )
    def _nightly(
        context: dg.ScheduleEvaluationContext,
        zarr_store: ZarrStoreResource,
        ct_settings: CTSettings,
        spike_settings: SpikeSettings,
        image_settings: ImageSettings,
    ):
        settings = {"ct": ct_settings, "spike": spike_settings, "images": image_settings}[family]
        store = zarr_store.store()
        keys = list(context.instance.get_dynamic_partitions(partitions.name))
        with gc_paused():  # records and catalog items of every partition, none garbage
            index = zarr_store.catalog(family).index()
            reasons = out_of_date(declared, store, settings.values(), keys, index)
        when = context.scheduled_execution_time.strftime("%Y-%m-%d")
        ordered = sorted(reasons.items())
        now, later = ordered[:PER_TICK], ordered[PER_TICK:]
        if later:  # the discovery sensor releases them as runs finish
            queued = {k: f"nightly {when}: {why}" for k, why in later}
            BuildQueue(store.backend, family).add(queued)
            context.log.info(f"{len(later)} more {family} partitions wait in the build queue")
        requests = [
            dg.RunRequest(
                partition_key=k, run_key=f"{family}:{k}:{when}", tags={"zarrfeed/reason": why}
            )
            for k, why in now
        ]
        if requests:
            return requests
        orphans = sorted(k for k in keys if k not in index or index[k].conflict)
        if orphans:  # out_of_date cannot build these: never call them current
            return dg.SkipReason(
                f"{len(keys) - len(orphans)} {family} partitions are current; "
                f"{len(orphans)} have no raw source of their own ({', '.join(orphans[:10])}): "
                f"`zarrfeed status` says how to fix each"
            )
        return dg.SkipReason(f"all {len(keys)} {family} partitions are current")

    return _nightly


store_maintenance_nightly = dg.ScheduleDefinition(
    name="store_maintenance_nightly",
    cron_schedule="0 3 * * *",
    job_name="store_maintenance",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Removes versions crashed or interrupted writers left in the store.",
    tags={"stage": "maintenance"},
    owners=OWNERS,
)
