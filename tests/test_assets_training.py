"""Model assets in a real Dagster instance: run config is the trainer's config, metadata has
what a person checks, and automation trains on a dataset update even with a missing scan."""

import base64

import dagster as dg
import pytest
from graph import base_resources
from graph import dataset_assets as all_dataset_assets
from graph import model_assets as all_model_assets

from zarrfeed.datasets import read_manifest, write_dataset
from zarrfeed.datasets.snapshots import is_id
from zarrfeed.resources import ModelsResource, RawFolderResource, ZarrStoreResource
from zarrfeed.training.tasks import TASK_TYPES

dataset_assets, model_assets = all_dataset_assets(), all_model_assets()


@pytest.fixture
def trained_env(built, tmp_path):
    store, raw = built
    resources = {
        **base_resources(),
        "zarr_store": ZarrStoreResource(url=store.url),
        "raw": RawFolderResource(root=str(raw)),
        "models": ModelsResource(root=str(tmp_path / "models")),
    }
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        yield resources, instance


def quick(task: str, **train) -> dict:
    return {task: {"config": {"dataloader": {"workers": "1"}, "train": {"steps": 4, **train}}}}


@pytest.mark.slow
def test_model_assets_train_from_run_config_with_metadata(trained_env, tmp_path):
    resources, instance = trained_env
    ops = {
        **quick("ct_classifier_model"),
        **quick("sparse_autoencoder_model", width=4),
        **quick("spike_deblur_model"),
        **quick("defect_segmentation_model"),
    }
    # One run, manifests first: a second in-process materialize in this process can meet a
    # dead instance weakref that Dagster keeps in a context variable (seen once in CI).
    result = dg.materialize(
        [*dataset_assets, *model_assets],
        resources=resources,
        instance=instance,
        run_config={"ops": ops},
    )
    assert result.success
    for asset in model_assets:
        key = asset.key
        meta = result.asset_materializations_for_node(key.path[0])[0].metadata
        assert meta["steps"].value == 4 and meta["final_loss"].value > 0
        assert 0 < meta["data_wait_share"].value < 1 and meta["samples_per_s"].value > 0
        assert "eval_loss" in meta and "eval_loss_before" in meta
        png = meta["loss_curve"].value.split("base64,")[1].rstrip(")")
        assert base64.b64decode(png)[:4] == b"\x89PNG"
        task = key.path[0][: -len("_model")]
        settings = {r.data["setting"]: r.data["value"] for r in meta["settings"].records}
        assert settings["train.steps"] == "4" and settings["task"] == task
        own = {f"data.{f}" for f in TASK_TYPES[task].data_fields}
        assert {k for k in settings if k.startswith("data.")} == own  # no other task's fields
        trained_on = {r.data["what"]: r.data["value"] for r in meta["trained_on"].records}
        dataset = TASK_TYPES[task].family.dataset_asset
        assert int(trained_on["partitions"]) > 0
        # What it read is what Dagster records as its input: one dataset version id.
        tags = instance.get_latest_materialization_event(key).asset_materialization.tags
        read = trained_on["dataset_version"]
        assert is_id(read) and trained_on[f"data version of {dataset}"] == read
        assert tags[f"dagster/input_data_version/{dataset}"] == read
        assert ("auroc_per_finding" in meta) == (task == "ct_classifier")
        checkpoint = meta["dagster/uri"].value
        assert meta["checkpoint"].value == checkpoint
        assert checkpoint.startswith(str(tmp_path / "models")) and result.run_id in checkpoint
    checks = [c for c in result.get_asset_check_evaluations() if c.check_name == "learned"]
    assert len(checks) == 4


def test_training_runs_on_a_dataset_update_despite_a_missing_partition(trained_env):
    resources, instance = trained_env
    defs = dg.Definitions(assets=[*dataset_assets, *model_assets], resources=resources)
    model = dg.AssetKey("defect_segmentation_model")
    first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    # a new image set is discovered but not built yet: eager() would wait for it forever
    instance.add_dynamic_partitions("image_sets", ["not_built_yet"])
    images_dataset = next(a for a in dataset_assets if a.key.path == ["images_dataset"])
    assert dg.materialize([images_dataset], resources=resources, instance=instance).success
    after = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=first.cursor)
    assert after.get_num_requested(model) == 1
    others = [a.key for a in model_assets if a.key != model]
    assert all(after.get_num_requested(k) == 0 for k in others)  # only its own family


def test_a_model_reads_the_dataset_version_dagster_records_as_its_input(trained_env):
    """A dataset build that moved the store on while the model starts (its materialisation
    not recorded yet): the model trains on the version Dagster knows, and its lineage names
    exactly that one."""
    resources, instance = trained_env
    images_dataset = next(a for a in dataset_assets if a.key.path == ["images_dataset"])
    model = next(a for a in model_assets if a.key.path == ["defect_segmentation_model"])
    assert dg.materialize([images_dataset], resources=resources, instance=instance).success
    known = instance.get_latest_data_version_record(images_dataset.key)
    known = known.asset_materialization.tags["dagster/data_version"]
    store = resources["zarr_store"].store()
    manifest = read_manifest(store, "images")
    assert manifest["id"] == known
    paths = list(manifest["assets"])
    moved = write_dataset(store, "images", paths, {manifest["keys"][0]: ["a build under way"]})
    assert moved["id"] != known and read_manifest(store, "images")["id"] == moved["id"]
    try:
        result = dg.materialize(
            [model],
            resources=resources,
            instance=instance,
            run_config={"ops": quick("defect_segmentation_model")},
        )
    finally:  # the session's store again as the other tests know it
        assert dg.materialize([images_dataset], resources=resources, instance=instance).success
    assert result.success
    meta = result.asset_materializations_for_node(model.key.path[0])[0].metadata
    trained_on = {r.data["what"]: r.data["value"] for r in meta["trained_on"].records}
    assert trained_on["dataset_version"] == known
    assert int(trained_on["partitions"]) == len(manifest["keys"])
    tags = instance.get_latest_materialization_event(model.key).asset_materialization.tags
    assert tags["dagster/input_data_version/images_dataset"] == known
