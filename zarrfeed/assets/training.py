"""Model assets: one per training task, trained on its family's dataset manifest.

They retrain when the manifest they read has a new data version and nothing upstream is
running (``zarrfeed.assets.conditions.ON_NEW_DATA``, as the manifests follow the stores; not
``eager()``, which one missing partition would block), never on a manifest rewritten with the
same data.
The run config is :class:`zarrfeed.training.config.TrainConfig` itself, turned into a Dagster
``Config`` here, so YAML files and the launchpad take the same fields.  Training runs outside
the step, as ``torchrun`` through Dagster Pipes (:mod:`zarrfeed.assets.torchrun`), one
model at a time per pool slot.
"""

# No "from __future__ import annotations": Dagster reads the config annotation at runtime.
import hashlib
import typing
from typing import Any

import dagster as dg
import pydantic
from pydantic.fields import FieldInfo

from zarrfeed.assets.build import OWNERS
from zarrfeed.assets.conditions import ON_NEW_DATA
from zarrfeed.assets.torchrun import TorchrunResource
from zarrfeed.datasets.snapshots import is_id
from zarrfeed.resources import ModelsResource, ZarrStoreResource
from zarrfeed.training.config import TrainConfig
from zarrfeed.training.tasks import LEARNED, LEARNED_DOC, TASK_TYPES, model_asset_name

TRAINING_POOL = "zarrfeed_training"  # one training at a time unless its limit is raised
# Set by the asset from its task and the resources, not by run config.
FROM_ASSET = {"task", "store", "out", "run_name"}


def dagster_config(defaults: pydantic.BaseModel, name: str) -> type[dg.Config]:
    """A Dagster ``Config`` class with the fields and docs of ``defaults``' model and its
    values as defaults (a task's own, see ``Task.defaults``), so the launchpad shows and an
    automated run uses what the task trains with."""
    model = type(defaults)
    fields: dict[str, Any] = {}
    for field_name, info in model.model_fields.items():
        if issubclass(model, TrainConfig) and field_name in FROM_ASSET:
            continue
        kind, value = info.annotation, getattr(defaults, field_name)
        if _optional_model(kind):
            # an optional section (data.augment): any mapping, which the run's TrainConfig
            # validates as it does a YAML file's (Dagster's maps hold no nulls: "off")
            given = value.model_dump(mode="json") if value is not None else None
            fields[field_name] = (Any, FieldInfo(default=given, description=info.description))
        elif isinstance(value, pydantic.BaseModel):
            section = dagster_config(value, f"{name}{type(value).__name__}")
            fields[field_name] = (section, FieldInfo(default_factory=section))
        else:
            fields[field_name] = (kind, FieldInfo(default=value, description=info.description))
    return pydantic.create_model(name, __base__=dg.Config, __doc__=model.__doc__, **fields)


def _optional_model(kind: Any) -> bool:
    """Whether ``kind`` is ``SomeModel | None`` (which Dagster config cannot hold)."""
    members = typing.get_args(kind)
    return type(None) in members and any(
        isinstance(m, type) and issubclass(m, pydantic.BaseModel) for m in members
    )


def model_asset(task: str) -> dg.AssetsDefinition:
    family = TASK_TYPES[task].family
    dataset = dg.AssetKey(family.dataset_asset)
    defaults = TrainConfig.model_validate({"task": task})
    run_config = dagster_config(defaults, f"TrainRun_{task}")
    # A changed default recipe marks the model stale in the UI, like a changed trainer.
    recipe = hashlib.sha256(defaults.model_dump_json(exclude=FROM_ASSET).encode()).hexdigest()

    @dg.asset(
        name=model_asset_name(task),
        group_name="training",
        deps=[dataset],
        code_version=f"{TASK_TYPES[task].version}.{recipe[:8]}",
        automation_condition=ON_NEW_DATA,
        kinds={"pytorch"},
        pool=TRAINING_POOL,
        description=(TASK_TYPES[task].__doc__ or "").strip(),
        owners=OWNERS,
        tags={"family": family.name, "stage": "model"},
        check_specs=[
            dg.AssetCheckSpec(LEARNED, asset=model_asset_name(task), description=LEARNED_DOC)
        ],
    )
    def _model(
        context: dg.AssetExecutionContext,
        config: run_config,  # type: ignore[valid-type]
        zarr_store: ZarrStoreResource,
        models: ModelsResource,
        torchrun: TorchrunResource,
    ):
        run = context.run
        # The dataset version Dagster knows as the latest (its data version is the version's
        # id): the model reads exactly it, so the input data version Dagster records is
        # what it trained on, even when a dataset build moved the store on meanwhile.
        record = context.instance.get_latest_data_version_record(dataset)
        event = record.asset_materialization if record else None
        version = event.tags.get("dagster/data_version") if event else None
        data = config.model_dump().get("data", {})
        if is_id(version) and not data.get("dataset_version"):
            data = {**data, "dataset_version": version}
        settings = TrainConfig.model_validate(
            {
                **config.model_dump(),
                "data": data,
                "task": task,
                "store": zarr_store.url,
                "out": models.root,
                # a re-execution of a failed run resumes from its checkpoint; new runs start fresh
                "run_name": run.root_run_id or run.run_id,
            }
        )
        read = data.get("dataset_version") or version
        trained_on = {"data_versions": {dataset.to_user_string(): read}}
        yield from torchrun.train(context, settings, {"trained_on": trained_on}).get_results()

    return _model
