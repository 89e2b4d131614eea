"""The README's main command, ``zarrfeed demo``; the ``dagster asset materialize`` CLI against
the instance it leaves behind; and ``dagster dev`` on that instance training a model, with no
click, after a new raw image set appears."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagsterdev import start_dagster_dev, wait_for

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo run once in a fresh folder: (folder, env pointing at what it made)."""
    tmp = tmp_path_factory.mktemp("demo")
    home, store, raw = tmp / "home", tmp / "store.zarr", tmp / "raw"
    args = ["demo", "--raw", raw, "--store", store, "--dagster-home", home]
    out = subprocess.run(
        [BIN / "zarrfeed", *args], capture_output=True, text=True, timeout=500, cwd=tmp
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "13/13 runs succeeded" in out.stdout
    assert "NO" not in out.stdout.split("family", 1)[1]
    env = {**os.environ, "DAGSTER_HOME": str(home), "ZARRFEED_RAW": str(raw),
           "ZARRFEED_STORE": str(store), "ZARRFEED_MODELS": str(tmp / "models")}  # fmt: skip
    return tmp, env


def instance_at(home: str):
    os.environ["DAGSTER_HOME"] = home
    try:
        return dg.DagsterInstance.get()
    finally:
        del os.environ["DAGSTER_HOME"]


def test_demo_builds_everything_and_the_cli_materialises_a_partition(demo):
    tmp, env = demo
    # one asset, and one asset of the subsettable ct_derived step
    for asset, key in (("image_store", "inspection_test"), ("ct_sparse", "train_1_a_1")):
        cmd = ["asset", "materialize", "-m", "zarrfeed.definitions", "--select", asset,
               "--partition", key]  # fmt: skip
        cli = subprocess.run(
            [BIN / "dagster", *cmd], capture_output=True, text=True, timeout=300, env=env, cwd=tmp
        )
        assert cli.returncode == 0, cli.stderr[-3000:]
    with instance_at(env["DAGSTER_HOME"]) as instance:
        for asset, n in (("ct_windows", 4), ("spike_voxels", 2), ("image_patches", 2)):
            assert len(instance.get_materialized_partitions(dg.AssetKey(asset))) == n
        assert instance.get_latest_materialization_event(dg.AssetKey("ct_dataset"))
        for task in ("ct_classifier", "sparse_autoencoder", "spike_deblur", "defect_segmentation"):
            assert instance.get_latest_materialization_event(dg.AssetKey(f"{task}_model"))
        runs = instance.get_runs()
        assert len(runs) == 15 and all(r.is_success for r in runs)
        last = instance.get_records_for_run(runs[0].run_id).records
        made = {r.event_log_entry.dagster_event.asset_key for r in last
                if r.event_log_entry.is_dagster_event
                and r.event_log_entry.dagster_event.is_step_materialization}  # fmt: skip
        assert made == {dg.AssetKey("ct_sparse")}  # the subset alone


def test_a_new_raw_image_set_ends_in_a_trained_model_without_a_click(demo):
    tmp, env = demo
    model = dg.AssetKey("defect_segmentation_model")
    with instance_at(env["DAGSTER_HOME"]) as instance:
        before = instance.get_latest_materialization_event(model).run_id
    with start_dagster_dev(env, tmp / "dagster_dev.log"):
        # a new inspection set: discovery → images_build → image_dataset → the model
        raw = Path(env["ZARRFEED_RAW"]) / "inspection"
        shutil.copytree(raw / "test", raw / "extra")

        def retrained():
            with instance_at(env["DAGSTER_HOME"]) as instance:
                event = instance.get_latest_materialization_event(model)
                if event.run_id != before and instance.get_run_by_id(event.run_id).is_finished:
                    return event
                return None

        log = (tmp / "dagster_dev.log").read_text
        try:
            event = wait_for(retrained, 420, "defect_segmentation_model to be retrained")
        except AssertionError:
            raise AssertionError(log()[-4000:]) from None
    with instance_at(env["DAGSTER_HOME"]) as instance:
        run = instance.get_run_by_id(event.run_id)
        assert run.is_success and run.tags.get("dagster/from_automation_condition") == "true"
        assert "inspection_extra" in instance.get_dynamic_partitions("image_sets")
        meta = event.asset_materialization.metadata
        assert meta["trained_on"].value["partitions"] == 3  # the new set is in the manifest
