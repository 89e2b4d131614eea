"""Model assets: one per training task, trained on its family's dataset manifest.

They refresh when the manifest they read was updated and nothing upstream is running (the
condition the dataset manifests use; not ``eager()``, which one missing partition would block).
The run config is :class:`zarrfeed.training.config.TrainConfig` itself, turned into a Dagster
``Config`` here, so YAML files and the launchpad take the same fields.
"""

# No "from __future__ import annotations": Dagster reads the config annotation at runtime.
from typing import Any

import dagster as dg
import pydantic
from pydantic.fields import FieldInfo

from zarrfeed.assets.datasets import ON_ANY_PARTITION_UPDATE
from zarrfeed.assets.metadata import png_markdown
from zarrfeed.resources import ModelsResource, ZarrStoreResource
from zarrfeed.training.config import TrainConfig
from zarrfeed.training.report import loss_curve_png
from zarrfeed.training.tasks import TASK_TYPES
from zarrfeed.training.trainer import TrainResult, train

TRAINER_VERSION = "1"
# Set by the asset from its task and the resources, not by run config.
FROM_ASSET = {"task", "store", "out", "run_name"}


def dagster_config(model: type[pydantic.BaseModel], name: str) -> type[dg.Config]:
    """``model`` as a Dagster ``Config`` class with the same fields, defaults and docs."""
    fields: dict[str, Any] = {}
    for field_name, info in model.model_fields.items():
        if model is TrainConfig and field_name in FROM_ASSET:
            continue
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, pydantic.BaseModel):
            section = dagster_config(kind, f"{name}{kind.__name__}")
            fields[field_name] = (section, FieldInfo(default_factory=section))
        else:
            fields[field_name] = (
                kind,
                FieldInfo(default=info.default, description=info.description),
            )
    return pydantic.create_model(name, __base__=dg.Config, __doc__=model.__doc__, **fields)


TrainRunConfig = dagster_config(TrainConfig, "TrainRun")


def result_metadata(result: TrainResult, upstream: dict[str, str | None]) -> dict[str, Any]:
    """What a person checks on a trained model: metrics, curve, speed, config, data."""
    losses = result.history["loss"]
    return {
        "dagster/uri": dg.MetadataValue.path(result.checkpoint),
        "steps": result.step,
        "resumed_from_step": result.resumed_from,
        "final_loss": losses[-1],
        **{f"eval_{k}": v for k, v in result.eval_after.items()},
        **{f"eval_{k}_before": v for k, v in result.eval_before.items()},
        "loss_curve": png_markdown(loss_curve_png(losses, title=result.task), "loss curve"),
        "data_wait_share": round(result.data_wait_share, 4),
        "samples_per_s": round(result.samples_per_s, 2),
        "peak_gpu_memory_mb": round(result.peak_memory_mb, 1),
        "loader": dg.MetadataValue.md("\n".join(f"- {r}" for r in result.loader)),
        "config": dg.MetadataValue.json(result.config),
        "trained_on": dg.MetadataValue.json({**result.data, "data_versions": upstream}),
    }


def model_asset(task: str) -> dg.AssetsDefinition:
    dataset = dg.AssetKey(f"{TASK_TYPES[task].family}_dataset")

    @dg.asset(
        name=f"{task}_model",
        group_name="training",
        deps=[dataset],
        code_version=TRAINER_VERSION,
        automation_condition=ON_ANY_PARTITION_UPDATE,
        kinds={"pytorch"},
        description=(TASK_TYPES[task].__doc__ or "").strip(),
        check_specs=[dg.AssetCheckSpec("loss_fell", asset=f"{task}_model")],
    )
    def _model(
        context: dg.AssetExecutionContext,
        config: TrainRunConfig,  # type: ignore[valid-type]
        zarr_store: ZarrStoreResource,
        models: ModelsResource,
    ):
        run = context.run
        settings = TrainConfig.model_validate(
            {
                **config.model_dump(),
                "task": task,
                "store": zarr_store.url,
                "out": models.root,
                # a re-execution of a failed run resumes from its checkpoint; new runs start fresh
                "run_name": run.root_run_id or run.run_id,
            }
        )
        result = train(settings, log=context.log.info)
        record = context.instance.get_latest_data_version_record(dataset)
        upstream = {
            dataset.to_user_string(): record.asset_materialization.tags.get("dagster/data_version")
            if record and record.asset_materialization
            else None
        }
        yield dg.MaterializeResult(metadata=result_metadata(result, upstream))
        before, after = result.eval_before["loss"], result.eval_after["loss"]
        yield dg.AssetCheckResult(
            check_name="loss_fell",
            passed=after < before,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={"eval_loss_before": before, "eval_loss_after": after},
            description="The loss on fixed evaluation batches is lower after training.",
        )

    return _model


model_assets = [model_asset(task) for task in TASK_TYPES]
