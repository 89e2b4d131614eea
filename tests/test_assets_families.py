"""Spike and image families, dataset manifests, reuse/force, batched runs, nightly schedule."""

import gc
import os
import time
import weakref
from dataclasses import replace
from datetime import datetime

import dagster as dg
import numpy as np
import pytest
import zarr
from graph import (
    build,
    build_datasets,
    checks,
    discover,
    failure,
    family_assets,
    requested,
    schedule,
    sensor,
)

from zarrfeed.assets.workers import stage_builds
from zarrfeed.datasets import read_manifest
from zarrfeed.families import Inputs, Stage, Step
from zarrfeed.families.ct import CT
from zarrfeed.families.images import IMAGES
from zarrfeed.families.spike import SPIKE
from zarrfeed.formats import read_dat, read_image
from zarrfeed.jobs.discovery import discover_into
from zarrfeed.resources import BuildOptions
from zarrfeed.transforms.spike import voxel_bins

SPIKE_KEYS = ["test_GOPR0384_11_00", "train_GOPR0372_07_00"]
IMAGE_KEYS = ["inspection_test", "inspection_train"]
CT_KEYS = ["train_1_a_1", "train_1_a_2", "train_2_a_1", "valid_1_a_1"]


def test_discovery_sensors_find_spike_sequences_and_image_sets(dagster_env):
    _, resources, instance = dagster_env
    ctx = dg.build_sensor_context(instance=instance, resources=resources)
    for name, keys in (("spike_discovery", SPIKE_KEYS), ("images_discovery", IMAGE_KEYS)):
        result = sensor(resources, name)(ctx)
        assert list(requested(result.run_requests, keys)) == keys
        assert result.dynamic_partitions_requests[0].partition_keys == keys


@pytest.mark.slow
def test_spike_and_image_families_match_their_sources_and_reach_the_datasets(dagster_env):
    raw, resources, instance = dagster_env
    store = resources["zarr_store"].store()
    for family, keys in (("spike", SPIKE_KEYS), ("images", IMAGE_KEYS)):
        assert discover(instance, resources, family) == keys
        for key in keys:
            assert all(checks(build(resources, instance, family, key)).values())
    # Independent recomputation from the raw files.
    seq = raw / "gopro-spike/train/GOPR0372_07_00"
    spikes = read_dat(seq / "spike_packed/000003.dat", 96, 160, "packed", 40)
    voxels = store.read_array("spike/voxels", "train_GOPR0372_07_00", "voxels")
    np.testing.assert_array_equal(voxels[3], voxel_bins(spikes, 5))
    sharp = store.read_array("spike/frames", "train_GOPR0372_07_00", "sharp")
    np.testing.assert_array_equal(sharp[3], read_image(seq / "sharp/000003.png"))
    images = store.read_array("images/images", "inspection_test", "images")
    np.testing.assert_array_equal(images[1], read_image(raw / "inspection/test/0007.png"))
    patches = store.open_partition("images/patches", "inspection_test")
    assert patches["origins"].shape[0] == patches["items"].shape[0] > 0

    discover(instance, resources, "ct")
    build(resources, instance, "ct", "train_1_a_1")
    result = build_datasets(resources, instance)
    assert all(checks(result).values())
    assert read_manifest(store, "spike")["keys"] == SPIKE_KEYS
    assert read_manifest(store, "images")["keys"] == IMAGE_KEYS
    ct = read_manifest(store, "ct")
    assert ct["keys"] == ["train_1_a_1"]
    assert set(ct["assets"]) == {"ct/hu", "ct/windows", "ct/sparse", "ct/patches"}


@pytest.mark.slow
def test_corrupted_store_data_is_rebuilt_and_force_rebuilds(dagster_env):
    _, resources, instance = dagster_env
    store = resources["zarr_store"].store()
    key = "inspection_test"
    discover(instance, resources, "images")
    build(resources, instance, "images", key)
    version = store.commit_record("images/patches", key)["version"]
    # A rerun with unchanged inputs reuses the partition (no rewrite) and re-checks it.
    result = build(resources, instance, "images", key)
    assert store.commit_record("images/patches", key)["version"] == version
    mat = result.asset_materializations_for_node("image_patches")[0]
    assert mat.metadata["reused"].value is True
    # Corrupt the stored index behind the store's back: the re-check catches it and the
    # partition is rebuilt from its source rather than served.
    origins = zarr.open_array(store.version_path("images/patches", key) + "/origins", mode="r+")
    origins[0] = [900, 100]
    result = build(resources, instance, "images", key)
    assert all(checks(result).values())
    mat = result.asset_materializations_for_node("image_patches")[0]
    assert mat.metadata["why"].value == "stored data failed its checks"
    rebuilt = store.commit_record("images/patches", key)["version"]
    assert rebuilt != version and store.read_array("images/patches", key, "origins")[0, 0] < 900
    forced = {**resources, "build": BuildOptions(force=True)}
    result = build(forced, instance, "images", key)
    assert all(checks(result).values())
    assert store.commit_record("images/patches", key)["version"] not in (version, rebuilt)


@pytest.mark.slow
def test_batched_run_builds_many_partitions_and_names_the_bad_one(dagster_env):
    raw, resources, instance = dagster_env
    discover(instance, resources, "ct")
    assets = family_assets("ct", resources)
    raw_scan = [a for a in assets if a.node_def.name == "ct_raw_scan"]
    derived = [a for a in assets if a.node_def.name != "ct_raw_scan"]
    batch = {"dagster/asset_partition_range_start": CT_KEYS[0],
             "dagster/asset_partition_range_end": CT_KEYS[-1]}  # fmt: skip
    dg.materialize(raw_scan, tags=batch, resources=resources, instance=instance)
    result = dg.materialize(derived, tags=batch, resources=resources, instance=instance)
    assert result.success and all(checks(result).values())
    mats = [m for m in result.asset_materializations_for_node("ct_derived")
            if m.asset_key == dg.AssetKey("ct_windows")]  # fmt: skip
    assert sorted(m.partition for m in mats) == CT_KEYS
    assert len({m.tags["dagster/data_version"] for m in mats}) == 4  # each its own
    # each partition's check results are its own (the UI shows and plots them per partition)
    own = {(c.check_name, c.partition) for c in result.get_asset_check_evaluations()
           if c.asset_key == dg.AssetKey("ct_windows") and c.partition}  # fmt: skip
    assert own == {("window_range", k) for k in CT_KEYS}
    store = resources["zarr_store"].store()
    assert store.list_partitions("ct/patches") == CT_KEYS
    before = store.read_array("ct/hu", "train_2_a_1", "hu")

    bad = raw / "ct-rate/dataset/train_fixed/train_2/train_2_a/train_2_a_1.nii.gz"
    bad.write_bytes(b"truncated")
    discover(instance, resources, "ct")
    forced = {**resources, "build": BuildOptions(force=True)}
    result = dg.materialize(derived, tags=batch, resources=forced, instance=instance,
                            raise_on_error=False)  # fmt: skip
    assert not result.success
    message = failure(result)
    assert "1 of 4 partitions failed" in message and "train_2_a_1.nii.gz" in message
    np.testing.assert_array_equal(store.read_array("ct/hu", "train_2_a_1", "hu"), before)


@pytest.mark.slow
def test_nightly_schedule_requests_missing_and_changed_partitions(dagster_env):
    raw, resources, instance = dagster_env
    discover(instance, resources, "spike")
    nightly = schedule(resources, "spike_nightly")

    def asked():
        with dg.build_schedule_context(
            instance=instance, resources=resources,
            scheduled_execution_time=datetime(2026, 11, 22, 2),
        ) as ctx:  # fmt: skip
            out = nightly(ctx)
        if isinstance(out, dg.SkipReason):
            return {}
        return requested(out, SPIKE_KEYS)

    assert asked() == dict.fromkeys(SPIKE_KEYS, "spike_voxels missing")
    for key in SPIKE_KEYS:
        build(resources, instance, "spike", key)
    assert asked() == {}
    changed = raw / "gopro-spike/test/GOPR0384_11_00/blur/000002.png"
    future = time.time() + 60
    os.utime(changed, (future, future))
    discover(instance, resources, "spike")
    assert asked() == {"test_GOPR0384_11_00": "raw item changed"}


@pytest.mark.parametrize("family", [CT, SPIKE, IMAGES], ids=lambda f: f.name)
def test_a_built_partition_frees_its_arrays_without_the_collector(dagster_env, family):
    """A partition's arrays go when its build ends, not when the cyclic collector next
    runs: a step whose closures hold the step (a reference cycle) would keep a CT volume's
    hundreds of MB per partition alive, beyond the memory a batched run budgets."""
    _, resources, instance = dagster_env
    store_resource = resources["zarr_store"]
    keys = discover_into(instance, family, resources["raw"], store_resource)
    settings = resources["ct_settings"].model_dump() if family is CT else {}
    values = family.values(settings)
    store = store_resource.store()
    inputs = Inputs(family, store, store_resource.catalog(family.name), values)
    made: list[weakref.ref] = []

    def tracked(stage: Stage) -> Stage:
        def build(inputs: Inputs, key: str) -> Step:
            step = stage.build(inputs, key)
            made.append(weakref.ref(step))
            return step

        return replace(stage, build=build)

    stages = [tracked(s) for s in family.stages]
    gc.collect()
    gc.disable()
    try:
        built = list(stage_builds(inputs, store, stages, values, False, keys[0]))
        assert len(built) == len(stages) == len(made)
        alive = [s.asset.name for s, ref in zip(family.stages, made, strict=True) if ref()]
        assert not alive, f"steps kept alive by a reference cycle: {alive}"
    finally:
        gc.enable()


@pytest.mark.slow
def test_16_bit_colour_and_exif_turned_images_are_stored_as_they_are(dagster_env):
    """A set of 16-bit RGB PNGs is stored as uint16, every bit kept (it was stored as uint8,
    shifted right by 8), and its patch index built on it; a JPEG with EXIF orientation 6 is
    stored as a viewer shows it, its tag in the partition's provenance."""
    from PIL import Image

    from zarrfeed.formats import write_image

    raw, resources, instance = dagster_env
    rng = np.random.default_rng(7)
    deep = [rng.integers(20000, 65536, (160, 144, 3)).astype(np.uint16) for _ in range(2)]
    (raw / "deep").mkdir()
    for i, image in enumerate(deep):
        write_image(raw / "deep" / f"{i}.png", image)
    (raw / "phone").mkdir()
    grid = np.full((144, 160, 3), 230, np.uint8)
    grid[:16, :16] = (255, 0, 0)
    im = Image.fromarray(grid)
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(raw / "phone" / "shot.jpg", exif=exif.tobytes(), quality=100, subsampling=0)
    assert {"deep", "phone"} <= set(discover(instance, resources, "images"))
    store = resources["zarr_store"].store()
    for key in ("deep", "phone"):
        assert all(checks(build(resources, instance, "images", key)).values())
    images = store.read_array("images/images", "deep", "images")
    assert images.dtype == np.uint16
    np.testing.assert_array_equal(images[:], np.stack(deep))
    assert store.read_array("images/patches", "deep", "items").shape[0] > 0
    shot = store.read_array("images/images", "phone", "images")[0]
    assert shot.shape == (160, 144, 3)  # the file's 144 × 160 grid, turned clockwise
    assert shot[4, -4, 0] > 200 and shot[4, -4, 1] < 60  # its top-left corner, top right
    attrs = store.commit_record("images/images", "phone")["attrs"]
    assert attrs["exif_orientation"] == {"shot.jpg": 6}
    assert store.commit_record("images/images", "deep")["attrs"]["exif_orientation"] == {}
