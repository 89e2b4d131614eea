"""Spike and image families, dataset manifests, reuse/force, batched runs, nightly schedule."""

import os
import time
from datetime import datetime

import dagster as dg
import numpy as np
import pytest
import zarr

from zarrfeed.assets import ct_assets, dataset_assets, image_assets, spike_assets
from zarrfeed.assets.partitions import ct_scans, image_sets, spike_sequences
from zarrfeed.formats import read_dat, read_image
from zarrfeed.jobs import schedules, sensors
from zarrfeed.resources import BuildOptions
from zarrfeed.transforms.spike import voxel_bins

SPIKE_KEYS = ["test_GOPR0384_11_00", "train_GOPR0372_07_00"]
IMAGE_KEYS = ["inspection_test", "inspection_train"]
CT_KEYS = ["train_1_a_1", "train_1_a_2", "train_2_a_1", "valid_1_a_1"]


def by_name(defs, name):
    return next(d for d in defs if d.name == name)


def add_all(instance):
    instance.add_dynamic_partitions(spike_sequences.name, SPIKE_KEYS)
    instance.add_dynamic_partitions(image_sets.name, IMAGE_KEYS)
    instance.add_dynamic_partitions(ct_scans.name, CT_KEYS)


def checks(result):
    return {(c.asset_key.to_user_string(), c.check_name): c.passed
            for c in result.get_asset_check_evaluations()}  # fmt: skip


def test_discovery_sensors_find_spike_sequences_and_image_sets(dagster_env):
    _, resources, instance = dagster_env
    ctx = dg.build_sensor_context(instance=instance, resources={"raw": resources["raw"]})
    for name, keys in (("spike_discovery", SPIKE_KEYS), ("images_discovery", IMAGE_KEYS)):
        result = by_name(sensors, name)(ctx)
        assert sorted(r.partition_key for r in result.run_requests) == keys
        assert result.dynamic_partitions_requests[0].partition_keys == keys


@pytest.mark.slow
def test_spike_and_image_families_match_their_sources_and_reach_the_datasets(dagster_env):
    raw, resources, instance = dagster_env
    add_all(instance)
    store = resources["zarr_store"].store()
    for key in SPIKE_KEYS:
        result = dg.materialize(spike_assets, partition_key=key, resources=resources,
                                instance=instance)  # fmt: skip
        assert all(checks(result).values())
    for key in IMAGE_KEYS:
        assert all(checks(dg.materialize(image_assets, partition_key=key, resources=resources,
                                         instance=instance)).values())  # fmt: skip
    # Independent recomputation from the raw files.
    seq = raw / "gopro-spike/train/GOPR0372_07_00"
    spikes = read_dat(seq / "spike_packed/000003.dat", 96, 160, "packed", 40)
    voxels = store.open_array("spike/voxels", "train_GOPR0372_07_00", "voxels")
    np.testing.assert_array_equal(voxels[3], voxel_bins(spikes, 5))
    frames = store.open_partition("spike/frames", "train_GOPR0372_07_00")
    np.testing.assert_array_equal(frames["sharp"][3], read_image(seq / "sharp/000003.png"))
    images = store.open_array("images/images", "inspection_test", "images")
    np.testing.assert_array_equal(images[1], read_image(raw / "inspection/test/0007.png"))
    patches = store.open_partition("images/patches", "inspection_test")
    assert patches["origins"].shape[0] == patches["items"].shape[0] > 0

    dg.materialize(ct_assets, partition_key="train_1_a_1", resources=resources, instance=instance)
    result = dg.materialize(dataset_assets, resources=resources, instance=instance)
    assert all(checks(result).values())
    assert store.read_manifest("spike")["keys"] == SPIKE_KEYS
    assert store.read_manifest("image")["keys"] == IMAGE_KEYS
    ct = store.read_manifest("ct")
    assert ct["keys"] == ["train_1_a_1"] and set(ct["assets"]) == {
        "ct/hu", "ct/windows", "ct/sparse", "ct/patches"}  # fmt: skip


@pytest.mark.slow
def test_checks_fail_on_corrupted_store_data_and_force_rebuilds(dagster_env):
    _, resources, instance = dagster_env
    add_all(instance)
    store = resources["zarr_store"].store()
    key = "inspection_test"
    dg.materialize(image_assets, partition_key=key, resources=resources, instance=instance)
    committed = store.commit_record("images/patches", key)["committed_unix"]
    # A rerun with unchanged inputs reuses the partition (no rewrite) and re-checks it.
    result = dg.materialize(image_assets, partition_key=key, resources=resources, instance=instance)
    assert store.commit_record("images/patches", key)["committed_unix"] == committed
    mat = result.asset_materializations_for_node("image_patches")[0]
    assert mat.metadata["reused"].value is True
    # Corrupt the stored index behind the store's back: the blocking check must catch it.
    origins = zarr.open_array(store.path("images/patches", key) + "/origins", mode="r+")
    origins[0] = [900, 100]
    result = dg.materialize(image_assets, partition_key=key, resources=resources,
                            instance=instance, raise_on_error=False)  # fmt: skip
    assert checks(result)[("image_patches", "in_bounds")] is False
    assert not result.success  # blocking
    forced = {**resources, "build": BuildOptions(force=True)}
    result = dg.materialize(image_assets, partition_key=key, resources=forced, instance=instance)
    assert all(checks(result).values())
    assert store.commit_record("images/patches", key)["committed_unix"] > committed


@pytest.mark.slow
def test_batched_run_builds_many_partitions_and_names_the_bad_one(dagster_env):
    raw, resources, instance = dagster_env
    add_all(instance)
    derived = ct_assets[1:]
    for key in CT_KEYS:  # raw ingest runs one partition per run
        dg.materialize(ct_assets[:1], partition_key=key, resources=resources, instance=instance)
    batch = {"dagster/asset_partition_range_start": CT_KEYS[0],
             "dagster/asset_partition_range_end": CT_KEYS[-1]}  # fmt: skip
    result = dg.materialize(derived, tags=batch, resources=resources, instance=instance)
    assert result.success and all(checks(result).values())
    mats = [m for m in result.asset_materializations_for_node("ct_derived")
            if m.asset_key == dg.AssetKey("ct_windows")]  # fmt: skip
    assert sorted(m.partition for m in mats) == CT_KEYS
    assert mats[0].metadata["batch_partitions"].value == 4
    store = resources["zarr_store"].store()
    assert store.list_partitions("ct/patches") == CT_KEYS
    before = store.open_array("ct/hu", "train_2_a_1", "hu")[...]

    bad = raw / "ct-rate/dataset/train_fixed/train_2/train_2_a/train_2_a_1.nii.gz"
    bad.write_bytes(b"truncated")
    forced = {**resources, "build": BuildOptions(force=True)}
    result = dg.materialize(derived, tags=batch, resources=forced, instance=instance,
                            raise_on_error=False)  # fmt: skip
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    message = failure.event_specific_data.error.to_string()
    assert "1 of 4 partitions failed" in message and "train_2_a_1.nii.gz" in message
    np.testing.assert_array_equal(store.open_array("ct/hu", "train_2_a_1", "hu")[...], before)


@pytest.mark.slow
def test_nightly_schedule_requests_missing_and_changed_partitions(dagster_env):
    raw, resources, instance = dagster_env
    add_all(instance)
    nightly = by_name(schedules, "spike_nightly")
    res = {"raw": resources["raw"], "zarr_store": resources["zarr_store"]}

    def requested():
        ctx = dg.build_schedule_context(
            instance=instance, resources=res, scheduled_execution_time=datetime(2026, 11, 22, 2)
        )
        out = nightly(ctx)
        return (
            {}
            if isinstance(out, dg.SkipReason)
            else {r.partition_key: r.tags["zarrfeed/reason"] for r in out}
        )

    assert requested() == dict.fromkeys(SPIKE_KEYS, "missing")
    for key in SPIKE_KEYS:
        dg.materialize(spike_assets, partition_key=key, resources=resources, instance=instance)
    assert requested() == {}
    changed = raw / "gopro-spike/test/GOPR0384_11_00/blur/000002.png"
    future = time.time() + 60
    os.utime(changed, (future, future))
    assert requested() == {"test_GOPR0384_11_00": "source changed after the last build"}
