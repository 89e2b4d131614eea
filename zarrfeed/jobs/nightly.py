"""Nightly schedules: rebuild exactly the partitions that are missing or out of date.

Consecutive partitions that need a build share a run (``zarrfeed.jobs.requests``).  Out of
date has one meaning, the data contract's (:meth:`zarrfeed.families.Family.out_of_date`
over ``zarrfeed.store.contract.stale_reason``): the committed fingerprint differs from the one
the current code, settings and inputs give.  The settings are the ones the family's assets
were defined with, so what the schedule calls stale is what the UI shows stale.
"""

from collections.abc import Mapping
from typing import Any

import dagster as dg

from zarrfeed.families import Family
from zarrfeed.jobs.queue import BuildQueue
from zarrfeed.jobs.requests import batched_requests
from zarrfeed.resources import ZarrStoreResource
from zarrfeed.store.bulk import gc_paused

NIGHTLY_CRON = "0 2 * * *"


def nightly_schedule(declared: Family, job, settings: Mapping[str, Any]) -> dg.ScheduleDefinition:
    """The family's nightly rebuild, judging staleness with ``settings``: the family's
    assets' own (``zarrfeed.assets.family.family_defs`` makes both)."""
    family, values = declared.name, declared.values(settings)

    @dg.schedule(
        name=declared.nightly,
        cron_schedule=NIGHTLY_CRON,
        job=job,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=f"Rebuilds the {family} partitions that are missing or out of date "
        "(changed source, settings or code).",
        tags={"family": family, "stage": "build"},
    )
    def _nightly(context: dg.ScheduleEvaluationContext, zarr_store: ZarrStoreResource):
        store = zarr_store.store()
        keys = list(context.instance.get_dynamic_partitions(declared.partitions))
        with gc_paused():  # records and catalog items of every partition, none garbage
            index = zarr_store.catalog(family).index()
            reasons = declared.out_of_date(store, values, keys, index)
        when = context.scheduled_execution_time.strftime("%Y-%m-%d")
        queue = BuildQueue(store.backend, family)
        # What the runs in flight leave room for now; the discovery sensor releases the rest.
        released = queue.release(context.instance, dict(sorted(reasons.items())), [keys], index)
        requests = batched_requests(job.name, family, released, lambda k: when)
        if requests:
            return requests
        if reasons:
            return dg.SkipReason(
                f"{len(reasons)} {family} partitions need a build: they wait in the build "
                "queue for runs in flight to finish"
            )
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
)
