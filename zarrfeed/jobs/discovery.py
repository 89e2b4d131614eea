"""Discovery sensors: every raw item under the raw folder becomes a partition and a build.

A tick scans the folder (no file is read), records what changed in the family's catalog and
asks for runs of the new and changed items only — consecutive items batched into one run
(``zarrfeed.jobs.requests``), a bounded number of items per tick, the rest waiting in the
build queue (``zarrfeed.jobs.queue``) for the next ticks; items whose source
is gone are reported on their raw asset, and ``zarrfeed partitions remove`` drops their
partitions.
"""

import hashlib
import json
import logging
import time

import dagster as dg

from zarrfeed.assets.partitions import partitions_def
from zarrfeed.families import Family
from zarrfeed.formats.walk import TreeCache
from zarrfeed.jobs.queue import BuildQueue
from zarrfeed.jobs.requests import batched_requests
from zarrfeed.resources import RawFolderResource, ZarrStoreResource
from zarrfeed.sources.catalog import RawCatalog
from zarrfeed.store.bulk import gc_paused


def discovery_sensor(declared: Family, job, dataset_job) -> dg.SensorDefinition:
    """New and changed raw items of ``declared`` become partitions and runs of ``job``; a
    changed set of conflicting keys, a run of ``dataset_job`` (the manifest leaves them
    out)."""
    partitions, raw_asset = partitions_def(declared), declared.raw.asset
    dataset = dg.AssetKey(declared.dataset_asset)
    family = declared.name
    walked = TreeCache()  # what the last tick's walk saw: unchanged folders are not listed

    @dg.sensor(
        name=declared.discovery,
        jobs=[job, dataset_job],
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Scans the raw folder for {family} items: new ones become partitions, "
        "new and changed ones get a build run, vanished ones are reported.",
        tags={"family": family, "stage": "discovery"},
    )
    def _discover(
        context: dg.SensorEvaluationContext, raw: RawFolderResource, zarr_store: ZarrStoreResource
    ) -> dg.SensorResult | dg.SkipReason:
        with gc_paused():  # 50,000 catalog items and listings, none of them garbage
            catalog = zarr_store.catalog(family)
            scan = raw.scan(declared, walked)
            changes = catalog.update(raw.origin, scan)
            report_skipped(context.log, catalog, raw.origin, family, scan.skipped)
            index = catalog.index()  # kept by update: no second read
            current = context.instance.get_dynamic_partitions(partitions.name)
            known = set(current)
            # Every catalogued key is a partition, also when an earlier tick died after updating
            # the catalog; the nightly schedule builds whatever such a tick did not request.
            new = sorted(set(index) - known)
            added = dict.fromkeys(changes.new, "new raw item")
            added.update(dict.fromkeys(changes.changed, "raw item changed"))
            # A run's range is resolved in Dagster's order of the partitions: the keys there
            # now, then the keys this tick adds, appended in the order it adds them.  A range
            # never spans the two, so it covers exactly the keys it was made of.
            released = BuildQueue(zarr_store.store().backend, family).release(
                context.instance, dict(sorted(added.items())), [current, new], index
            )
            # A key leaves the queue when released, so each release is a request of its own:
            # one that reused a run key (a key the nightly queued again after its run failed,
            # a file restored with its old size and mtime) would be dropped by the daemon.
            tick = str(time.time_ns())
            requests = batched_requests(
                job.name, family, released, lambda k: f"{index[k].stamp}\0{tick}"
            )
            conflicted = sorted(k for k, item in index.items() if item.conflict)
            # The cursor: the conflicts the manifest reflects, and how many changes of them
            # there were (a set that comes back needs a run key of its own).
            digest = _digest(json.dumps(conflicted))
            before, _, seen = (context.cursor or _digest("[]")).partition(":")
            changes_seen = int(seen or 0)
            if digest != before:
                changes_seen += 1
                requests.append(
                    dg.RunRequest(
                        job_name=dataset_job.name,
                        asset_selection=[dataset],
                        run_key=f"{family}:conflicts:{digest}:{changes_seen}",
                        tags={"zarrfeed/reason": "conflicting raw items changed"},
                    )
                )
            cursor = f"{digest}:{changes_seen}"
            gone = sorted(k for k in known - set(index))
            events = [
                dg.AssetObservation(
                    asset_key=raw_asset,
                    partition=k,
                    metadata={
                        "source": "gone",
                        "remove with": f"zarrfeed partitions remove {family} {k}",
                    },
                )
                for k in changes.gone
            ]
            if gone:
                context.log.warning(
                    f"{len(gone)} {family} partitions have no raw source: {gone[:20]}; remove each "
                    f"with `zarrfeed partitions remove {family} KEY`"
                )
            if not (new or requests or events):
                return dg.SkipReason(
                    f"no new, changed or queued {family} items among {changes.total} under "
                    f"{raw.root}"
                    + (
                        f"; {len(gone)} partitions without a source ({', '.join(gone[:10])}): "
                        f"`zarrfeed partitions remove {family} KEY`"
                        if gone
                        else ""
                    )
                )
            return dg.SensorResult(
                run_requests=requests,
                dynamic_partitions_requests=[partitions.build_add_request(new)] if new else [],
                asset_events=events,
                cursor=cursor,
            )

    return _discover


def report_skipped(
    log: logging.Logger | dg.DagsterLogManager,
    catalog: RawCatalog,
    origin: str,
    family: str,
    skipped: dict[str, str],
) -> None:
    """Log the broken entries discovery skipped, with their paths, and keep them for
    ``zarrfeed status``: a symlink loop must not stop discovery, nor vanish unreported."""
    catalog.record_skipped(origin, skipped)
    if skipped:
        listed = "; ".join(f"{path}: {why}" for path, why in list(skipped.items())[:20])
        log.warning(
            f"{family} discovery skipped {len(skipped)} raw entries (broken, hidden or "
            f"refused links): {listed}"
        )


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def discover_into(
    instance: dg.DagsterInstance,
    family: Family,
    raw: RawFolderResource,
    zarr_store: ZarrStoreResource,
) -> list[str]:
    """What a discovery tick does, done now: record the raw folder's items in the catalog and
    add their partitions (for the demo, the CLI and tests).  Returns every catalogued key."""
    catalog = zarr_store.catalog(family.name)
    with gc_paused():
        scan = raw.scan(family)
        catalog.update(raw.origin, scan)
        log = logging.getLogger("zarrfeed")
        report_skipped(log, catalog, raw.origin, family.name, scan.skipped)
        keys = sorted(catalog.index())
    name = family.partitions
    known = set(instance.get_dynamic_partitions(name))
    instance.add_dynamic_partitions(name, [k for k in keys if k not in known])
    return keys
