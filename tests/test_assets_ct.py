"""The CT branch against a real Dagster instance (temporary DAGSTER_HOME) and real Zarr."""

import shutil

import dagster as dg
import numpy as np
import pytest
from dagster._core.definitions.assets.graph.asset_graph import AssetGraph
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest

from zarrfeed.assets import ct_assets
from zarrfeed.assets.partitions import ct_scans
from zarrfeed.formats import write_nifti
from zarrfeed.jobs import sensors

KEYS = ["train_1_a_1", "train_1_a_2", "train_2_a_1", "valid_1_a_1"]


@pytest.fixture
def env(dagster_env):
    return dagster_env


def materialize(resources, instance, key, raise_on_error=True):
    return dg.materialize(ct_assets, partition_key=key, resources=resources, instance=instance,
                          raise_on_error=raise_on_error)  # fmt: skip


def test_discovery_sensor_adds_partitions_and_requests_runs(env):
    raw, resources, instance = env
    ct_scan_discovery = next(s for s in sensors if s.name == "ct_discovery")
    ctx = dg.build_sensor_context(instance=instance, resources={"raw": resources["raw"]})
    result = ct_scan_discovery(ctx)
    assert sorted(r.partition_key for r in result.run_requests) == KEYS
    assert result.dynamic_partitions_requests[0].partition_keys == KEYS
    instance.add_dynamic_partitions(ct_scans.name, KEYS)  # what the daemon does with the request
    assert isinstance(ct_scan_discovery(ctx), dg.SkipReason)
    src = raw / "ct-rate/dataset/valid_fixed/valid_1/valid_1_a/valid_1_a_1.nii.gz"
    shutil.copy(src, src.with_name("valid_9_a_1.nii.gz"))
    assert [r.partition_key for r in ct_scan_discovery(ctx).run_requests] == ["valid_9_a_1"]


@pytest.mark.slow
def test_branch_materialises_raw_and_hu_stored_scans_identically_twice(env):
    _, resources, instance = env
    instance.add_dynamic_partitions(ct_scans.name, KEYS)
    store = resources["zarr_store"].store()
    for key in ("train_1_a_1", "train_1_a_2"):  # raw values + CSV rescale, and HU on disk
        result = materialize(resources, instance, key)
        assert all(c.passed for c in result.get_asset_check_evaluations())
        hu = store.open_array("ct/hu", key, "hu")[...]
        assert hu.dtype == np.int16 and -1024 <= hu.min() < -950 and hu.max() > 200
        lung = store.open_array("ct/windows", key, "lung")
        assert lung.dtype == np.float16 and lung.chunks == tuple(min(64, n) for n in lung.shape)
        assert store.commit_record("ct/hu", key)["attrs"]["params"]["source_in_hu"] == (
            key == "train_1_a_2"
        )
    first = store.open_array("ct/windows", "train_1_a_1", "bone")[...]
    materialize(resources, instance, "train_1_a_1")
    np.testing.assert_array_equal(store.open_array("ct/windows", "train_1_a_1", "bone")[...], first)
    mat = instance.get_latest_materialization_event(dg.AssetKey("ct_windows")).asset_materialization
    assert (
        mat.metadata["compression_ratio"].value > 1
        and "data:image/png" in mat.metadata["preview"].value
    )


@pytest.mark.slow
def test_corrupt_input_fails_alone_and_keeps_committed_data(env):
    raw, resources, instance = env
    instance.add_dynamic_partitions(ct_scans.name, KEYS)
    store = resources["zarr_store"].store()
    materialize(resources, instance, "train_2_a_1")
    before = store.open_array("ct/hu", "train_2_a_1", "hu")[...]
    bad = raw / "ct-rate/dataset/train_fixed/train_2/train_2_a/train_2_a_1.nii.gz"
    bad.write_bytes(b"not a nifti file")
    result = materialize(resources, instance, "train_2_a_1", raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert "train_2_a_1.nii.gz" in failure.event_specific_data.error.to_string()
    np.testing.assert_array_equal(store.open_array("ct/hu", "train_2_a_1", "hu")[...], before)
    assert materialize(resources, instance, "valid_1_a_1").success


@pytest.mark.slow
def test_changed_raw_file_makes_only_its_partition_stale(env):
    raw, resources, instance = env
    instance.add_dynamic_partitions(ct_scans.name, KEYS)
    for key in ("train_1_a_1", "train_2_a_1"):
        materialize(resources, instance, key)
    changed = raw / "ct-rate/dataset/train_fixed/train_2/train_2_a/train_2_a_1.nii.gz"
    write_nifti(changed, np.full((20, 40, 40), -1000, dtype=np.int16), (5.0, 3.6, 3.6))
    for key in ("train_1_a_1", "train_2_a_1"):  # re-ingest: the hash is the data version
        dg.materialize([ct_assets[0]], partition_key=key, resources=resources, instance=instance)
    graph = AssetGraph.from_assets(ct_assets)
    # Dagster's own staleness resolver (what the UI shows); internal, pinned by dagster 1.13.
    status = CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance)).get_status
    assert status(dg.AssetKey("ct_hu"), "train_2_a_1") == StaleStatus.STALE
    assert status(dg.AssetKey("ct_hu"), "train_1_a_1") == StaleStatus.FRESH
