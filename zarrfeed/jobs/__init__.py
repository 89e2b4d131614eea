"""Build jobs per family, the sensors that turn new raw items into partitions and runs, the
nightly schedules that rebuild what is missing or stale, and the dataset automation sensor."""

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from zarrfeed.assets import ct, images, spike
from zarrfeed.assets.partitions import ct_scans, image_sets, spike_sequences
from zarrfeed.resources import RawFolderResource, ZarrStoreResource

NIGHTLY_CRON = "0 2 * * *"

# Raw ingest runs one partition per run (per-item data versions) while derived assets batch,
# so family jobs backfill one partition per run and asset backfills batch.  Intended.
warnings.filterwarnings("ignore", message=".*materializes assets with varying BackfillPolicies")


def _mtime(paths: list[Path]) -> float:
    return max((p.stat().st_mtime for p in paths), default=0.0)


# family → (partitions, raw items → {key: latest source mtime}, store assets → code versions)
FAMILIES: dict[str, tuple[dg.DynamicPartitionsDefinition, Callable, Mapping[str, str]]] = {
    "ct": (ct_scans, lambda raw: {k: _mtime([p]) for k, p in raw.ct_scans().items()}, ct.VERSIONS),
    "spike": (
        spike_sequences,
        lambda raw: {k: _mtime(s.files()) for k, s in raw.spike_sequences().items()},
        spike.VERSIONS,
    ),
    "images": (
        image_sets,
        lambda raw: {k: _mtime(images.image_files(f)) for k, f in raw.image_sets().items()},
        images.VERSIONS,
    ),
}


def build_job(family: str) -> UnresolvedAssetJobDefinition:
    return dg.define_asset_job(
        f"{family}_build",
        selection=dg.AssetSelection.groups(family),
        description=f"Build the {family} stores for the chosen partitions.",
    )


def discovery_sensor(family: str, job: UnresolvedAssetJobDefinition) -> dg.SensorDefinition:
    partitions, sources, _ = FAMILIES[family]

    @dg.sensor(
        name=f"{family}_discovery",
        job=job,
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
    )
    def _discover(context: dg.SensorEvaluationContext, raw: RawFolderResource):
        """Every new raw item under the raw folder becomes a partition and gets a build run."""
        found = sources(raw)
        known = set(context.instance.get_dynamic_partitions(partitions.name))
        new, gone = sorted(set(found) - known), sorted(known - set(found))
        if gone:
            context.log.warning(
                f"{len(gone)} {family} partitions have no raw source any more: {gone[:20]}"
            )
        if not new:
            return dg.SkipReason(
                f"no new {family} items among {len(found)} under {raw.root}; {len(gone)} gone"
            )
        return dg.SensorResult(
            run_requests=[dg.RunRequest(partition_key=k, run_key=f"{family}:{k}") for k in new],
            dynamic_partitions_requests=[partitions.build_add_request(new)],
        )

    return _discover


def nightly_schedule(family: str, job: UnresolvedAssetJobDefinition) -> dg.ScheduleDefinition:
    partitions, sources, versions = FAMILIES[family]

    @dg.schedule(
        name=f"{family}_nightly",
        cron_schedule=NIGHTLY_CRON,
        job=job,
        default_status=dg.DefaultScheduleStatus.RUNNING,
    )
    def _nightly(
        context: dg.ScheduleEvaluationContext, raw: RawFolderResource, zarr_store: ZarrStoreResource
    ):
        """Rebuild partitions that are missing, built by older code, or older than their source.

        Only stat calls and commit records: cheap enough for every partition every night.
        Unchanged partitions in a run are reused, not rebuilt.
        """
        store, found = zarr_store.store(), sources(raw)
        when = context.scheduled_execution_time.strftime("%Y-%m-%d")
        requests = []
        for key in context.instance.get_dynamic_partitions(partitions.name):
            if key not in found:
                continue
            reasons = (store.outdated(a, key, v, found[key]) for a, v in versions.items())
            reason = next((r for r in reasons if r), None)
            if reason:
                requests.append(
                    dg.RunRequest(
                        partition_key=key,
                        run_key=f"{family}:{key}:{when}",
                        tags={"zarrfeed/reason": reason},
                    )
                )
        return requests or dg.SkipReason(f"all {family} partitions are current")

    return _nightly


build_jobs = {family: build_job(family) for family in FAMILIES}
datasets_build = dg.define_asset_job(
    "datasets_build",
    selection=dg.AssetSelection.groups("datasets"),
    description="Rewrite the dataset manifests from the committed partitions.",
)
sensors = [discovery_sensor(f, j) for f, j in build_jobs.items()]
schedules = [nightly_schedule(f, j) for f, j in build_jobs.items()]

hub_catalog = dg.define_asset_job(
    "hub_catalog",
    selection=dg.AssetSelection.assets("hub_ct_catalog"),
    description="List the hub split at a pinned commit; one partition per volume.",
)
hub_build = dg.define_asset_job(
    "hub_build",
    selection=dg.AssetSelection.assets("hub_ct_volume"),
    description="Download and preprocess the chosen hub volumes.",
)


def automation_sensor(group: str) -> dg.AutomationConditionSensorDefinition:
    """Evaluates the automation conditions of ``group``; running by default (Dagster's own
    default sensor starts stopped: shared/notes/dagster.md §2)."""
    return dg.AutomationConditionSensorDefinition(
        f"{group}_automation",
        target=dg.AssetSelection.groups(group),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=15,
    )


datasets_automation = automation_sensor("datasets")

train = dg.define_asset_job(
    "train",
    selection=dg.AssetSelection.groups("training"),
    description="Train every model on the current dataset manifests (run config: TrainConfig).",
)
training_automation = automation_sensor("training")
