"""Jobs: build a family's partitions, refresh the manifests, list the hub, train, tidy the
store."""

import dagster as dg

from zarrfeed.datasets import collect
from zarrfeed.families import Family
from zarrfeed.resources import ZarrStoreResource


def build_job(family: Family):  # an unresolved asset job (its type is not public)
    return dg.define_asset_job(
        family.build_job,
        selection=dg.AssetSelection.groups(family.name),
        description=f"Build the {family.name} stores for the chosen partitions: raw ingest, "
        "then every stored asset of the family (unchanged partitions are reused).",
        tags={"family": family.name, "stage": "build"},
    )


def dataset_job(family: Family):
    """Rewrite the family's dataset manifest (discovery asks for it when conflicts change)."""
    return dg.define_asset_job(
        family.dataset_job,
        selection=dg.AssetSelection.assets(family.dataset_asset),
        description=f"Rewrite the {family.name} dataset manifest from the committed, checked "
        "partitions.",
        tags={"family": family.name, "stage": "dataset"},
    )


def hub_job(family: Family):
    """List the family's hub source (its ``hub`` declaration) at a pinned commit."""
    assert family.hub is not None
    return dg.define_asset_job(
        family.hub.job,
        selection=dg.AssetSelection.assets(family.hub.asset),
        description=f"List a hub split at a pinned commit: its volumes become "
        f"{family.partitions} partitions.",
        tags={"family": family.name, "stage": "raw", "source": "huggingface"},
    )


datasets_build = dg.define_asset_job(
    "datasets_build",
    selection=dg.AssetSelection.groups("datasets"),
    description="Rewrite the dataset manifests from the committed, checked partitions.",
    tags={"stage": "dataset"},
)
train = dg.define_asset_job(
    "train",
    selection=dg.AssetSelection.groups("training"),
    description="Train every model on the current dataset manifests (run config: TrainConfig).",
    tags={"stage": "training"},
)


@dg.op(
    description="Remove what nothing retains: partition versions no commit, retained dataset "
    "version or live reader names, dataset versions past retention, dead writers' leftovers."
)
def collect_garbage(context: dg.OpExecutionContext, zarr_store: ZarrStoreResource) -> None:
    context.log.info(collect(zarr_store.store()).describe())


@dg.job(
    description="Tidy the store: versions nothing retains any more, and dataset versions "
    "past their retention.",
    tags={"stage": "maintenance"},
)
def store_maintenance() -> None:
    collect_garbage()
