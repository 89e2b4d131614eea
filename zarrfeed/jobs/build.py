"""Jobs: build a family's partitions, refresh the manifests, list the hub, train, tidy the
store."""

import warnings

import dagster as dg

from zarrfeed.assets.build import OWNERS
from zarrfeed.resources import ZarrStoreResource
from zarrfeed.store.contract import FAMILIES

# Raw ingest runs one partition per run (per-item data versions) while stored assets batch,
# so a family job backfills one partition per run and asset backfills batch.  Intended.
warnings.filterwarnings("ignore", message=".*materializes assets with varying BackfillPolicies")


def build_job(family: str):  # an unresolved asset job (its type is not public)
    return dg.define_asset_job(
        f"{family}_build",
        selection=dg.AssetSelection.groups(family),
        description=f"Build the {family} stores for the chosen partitions: raw ingest, then "
        "every stored asset of the family (unchanged partitions are reused).",
        tags={"family": family, "stage": "build"},
        owners=OWNERS,
    )


build_jobs = {family: build_job(family) for family in FAMILIES}
datasets_build = dg.define_asset_job(
    "datasets_build",
    selection=dg.AssetSelection.groups("datasets"),
    description="Rewrite the dataset manifests from the committed, checked partitions.",
    tags={"stage": "dataset"},
    owners=OWNERS,
)
hub_catalog = dg.define_asset_job(
    "hub_catalog",
    selection=dg.AssetSelection.assets("hub_ct_catalog"),
    description="List a hub split at a pinned commit: its volumes become ct_scans partitions.",
    tags={"family": "ct", "stage": "raw", "source": "huggingface"},
    owners=OWNERS,
)
train = dg.define_asset_job(
    "train",
    selection=dg.AssetSelection.groups("training"),
    description="Train every model on the current dataset manifests (run config: TrainConfig).",
    tags={"stage": "training"},
    owners=OWNERS,
)


@dg.op(description="Remove store versions no commit names that are older than the grace period.")
def collect_garbage(context: dg.OpExecutionContext, zarr_store: ZarrStoreResource) -> None:
    removed = zarr_store.store().collect_garbage()
    context.log.info(f"removed {removed} abandoned versions and temporary files")


@dg.job(
    description="Tidy the store: versions left by crashed or interrupted writers.",
    tags={"stage": "maintenance"},
    owners=OWNERS,
)
def store_maintenance() -> None:
    collect_garbage()
