"""The CT branch against a real Dagster instance (temporary DAGSTER_HOME) and real Zarr."""

import shutil
from datetime import datetime

import dagster as dg
import numpy as np
import pytest
from graph import (
    build,
    checks,
    discover,
    failure,
    family_assets,
    requested,
    runtime,
    schedule,
    sensor,
)

from zarrfeed.datasets import read_manifest
from zarrfeed.families.ct import CTSettings
from zarrfeed.formats import write_nifti

KEYS = ["train_1_a_1", "train_1_a_2", "train_2_a_1", "valid_1_a_1"]


def test_discovery_sensor_adds_partitions_requests_runs_and_reports_gone_sources(dagster_env):
    raw, resources, instance = dagster_env
    ct_discovery = sensor(resources, "ct_discovery")
    ctx = dg.build_sensor_context(instance=instance, resources=runtime(resources))
    result = ct_discovery(ctx)
    assert list(requested(result.run_requests, KEYS)) == KEYS
    assert len(result.run_requests) == 1  # consecutive new partitions: one batched run
    assert result.dynamic_partitions_requests[0].partition_keys == KEYS
    instance.add_dynamic_partitions("ct_scans", KEYS)  # what the daemon does with the request
    assert isinstance(ct_discovery(ctx), dg.SkipReason)
    folder = raw / "ct-rate/dataset/valid_fixed/valid_1/valid_1_a"
    shutil.copy(folder / "valid_1_a_1.nii.gz", folder / "valid_9_a_1.nii.gz")
    result = ct_discovery(ctx)
    assert list(requested(result.run_requests, [*KEYS, "valid_9_a_1"])) == ["valid_9_a_1"]
    instance.add_dynamic_partitions("ct_scans", ["valid_9_a_1"])
    (folder / "valid_9_a_1.nii.gz").unlink()
    write_nifti(folder / "valid_1_a_1.nii.gz", np.zeros((4, 8, 8), np.int16), (1.0, 1.0, 1.0))
    result = ct_discovery(ctx)
    assert requested(result.run_requests, KEYS) == {"valid_1_a_1": "raw item changed"}
    gone = [(e.partition, e.metadata["source"].value) for e in result.asset_events]
    assert gone == [("valid_9_a_1", "gone")]


@pytest.mark.slow
def test_branch_materialises_raw_and_hu_stored_scans_identically_twice(dagster_env):
    _, resources, instance = dagster_env
    discover(instance, resources, "ct")
    store = resources["zarr_store"].store()
    for key in ("train_1_a_1", "train_1_a_2"):  # raw values + CSV rescale, and HU on disk
        result = build(resources, instance, "ct", key)
        assert all(checks(result).values())
        assert {c.partition for c in result.get_asset_check_evaluations()} == {key}
        [window_range] = [c for c in result.get_asset_check_evaluations()
                          if c.check_name == "window_range"]  # fmt: skip
        assert window_range.metadata["out_of_range"].value == "none"  # never an empty {}
        hu = store.read_array("ct/hu", key, "hu")
        assert hu.dtype == np.int16 and -1024 <= hu.min() < -950 and hu.max() > 200
        lung = store.open_array("ct/windows", key, "lung")
        assert lung.dtype == np.float16 and lung.chunks == tuple(min(64, n) for n in lung.shape)
        decision = store.commit_record("ct/hu", key)["attrs"]["hu_rescale"]
        assert decision["intercept"] == (-1024 if key == "train_1_a_1" else 0), decision
    version = store.commit_record("ct/windows", "train_1_a_1")["version"]
    result = build(resources, instance, "ct", "train_1_a_1")  # unchanged: reused, re-checked
    assert all(checks(result).values())
    assert store.commit_record("ct/windows", "train_1_a_1")["version"] == version
    mat = instance.get_latest_materialization_event(dg.AssetKey("ct_windows")).asset_materialization
    assert mat.metadata["reused"].value is True
    assert mat.metadata["compression_ratio"].value > 1
    assert "data:image/png" in mat.metadata["preview"].value
    hu_meta = instance.get_latest_materialization_event(dg.AssetKey("ct_hu")).asset_materialization
    hu = store.read_array("ct/hu", "train_1_a_1", "hu")
    assert hu_meta.metadata["shape_zyx"].value == "×".join(map(str, hu.shape))
    assert hu_meta.metadata["spacing_zyx_mm"].value == "5 × 3 × 3"  # dagster_env's settings
    rows = {
        r.data["percentile"]: r.data["HU"] for r in hu_meta.metadata["hu_percentiles"].value.records
    }
    assert rows["p50"] == int(np.percentile(hu, 50, method="lower"))
    assert rows["p1"] < -900 < rows["p99"]  # air at the bottom of the distribution


@pytest.mark.slow
def test_corrupt_input_fails_alone_and_keeps_committed_data(dagster_env):
    raw, resources, instance = dagster_env
    discover(instance, resources, "ct")
    store = resources["zarr_store"].store()
    build(resources, instance, "ct", "train_2_a_1")
    before = store.read_array("ct/hu", "train_2_a_1", "hu")
    bad = raw / "ct-rate/dataset/train_fixed/train_2/train_2_a/train_2_a_1.nii.gz"
    bad.write_bytes(b"not a nifti file")
    discover(instance, resources, "ct")  # the catalog sees the change
    result = build(resources, instance, "ct", "train_2_a_1", raise_on_error=False)
    assert not result.success and "train_2_a_1.nii.gz" in failure(result)
    np.testing.assert_array_equal(store.read_array("ct/hu", "train_2_a_1", "hu"), before)
    assert build(resources, instance, "ct", "valid_1_a_1").success


def latest(instance, asset, key):
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[key]), limit=1
    ).records
    return records[0].asset_materialization


@pytest.mark.slow
def test_changes_make_exactly_the_affected_partitions_stale_and_the_nightly_rebuilds_them(
    dagster_env,
):
    raw, resources, instance = dagster_env
    discover(instance, resources, "ct")
    for key in ("train_1_a_1", "train_2_a_1"):
        build(resources, instance, "ct", key)

    def asked(res):  # the nightly schedule of the definitions ``res`` gives settings for
        """Partition -> the reasons of its (batched) run."""
        nightly = schedule(res, "ct_nightly")
        with dg.build_schedule_context(
            instance=instance,
            resources=runtime(res),
            scheduled_execution_time=datetime(2026, 11, 22, 2),
        ) as ctx:
            out = nightly(ctx)
        if isinstance(out, dg.SkipReason):
            return {}
        return {k: set(why.split("; ")) for k, why in requested(out, KEYS).items()}

    def covers(got, want):  # every wanted key, each with its reason among its run's
        return set(got) == set(want) and all(want[k] in got[k] for k in want)

    missing = {"train_1_a_2": "ct_hu missing", "valid_1_a_1": "ct_hu missing"}
    assert covers(asked(resources), missing)
    # A changed setting: a new code version for exactly the assets that declare it …
    values = {**resources["ct_settings"].model_dump(), "sparse_threshold": 0.7}
    changed = {**resources, "ct_settings": CTSettings(**values)}
    before = {a.node_def.name: a for a in family_assets("ct", resources)}
    after = {a.node_def.name: a for a in family_assets("ct", changed)}
    steps = {"ct_hu": ["ct_hu"], "ct_derived": ["ct_windows", "ct_sparse", "ct_patches"]}
    versions = {
        name: (
            before[step].code_versions_by_key[dg.AssetKey(name)],
            after[step].code_versions_by_key[dg.AssetKey(name)],
        )
        for step, names in steps.items()
        for name in names
    }
    assert [n for n, (a, b) in versions.items() if a != b] == ["ct_sparse"]
    recorded = latest(instance, "ct_sparse", "train_1_a_1").tags["dagster/code_version"]
    assert recorded == versions["ct_sparse"][0]  # what the UI compares with the new version
    # … and the nightly rebuilds exactly those partitions.
    why = "ct_sparse: inputs, settings or code changed since the last build"
    stale = dict.fromkeys(("train_1_a_1", "train_2_a_1"), why)
    assert covers(asked(changed), {**missing, **stale})
    # A changed raw file: a new data version for its raw partition only, and a rebuild.
    path = raw / "ct-rate/dataset/train_fixed/train_2/train_2_a/train_2_a_1.nii.gz"
    write_nifti(path, np.full((20, 40, 40), -1000, dtype=np.int16), (5.0, 3.6, 3.6))
    discover(instance, resources, "ct")
    assert covers(asked(resources), {**missing, "train_2_a_1": "raw item changed"})
    for key in ("train_1_a_1", "train_2_a_1"):
        old = latest(instance, "ct_raw_scan", key).tags["dagster/data_version"]
        raw_scan = [a for a in family_assets("ct", resources) if a.node_def.name == "ct_raw_scan"]
        dg.materialize(raw_scan, partition_key=key, resources=runtime(resources), instance=instance)
        new = latest(instance, "ct_raw_scan", key).tags["dagster/data_version"]
        assert (new != old) == (key == "train_2_a_1")  # so only its ct_hu is stale in the UI


@pytest.mark.slow
def test_a_rebuilt_partition_refreshes_the_manifest_and_a_reused_one_does_not(dagster_env):
    """A forced rebuild commits new versions with the same fingerprint and removes the ones
    the manifest pins: the manifest's automation must see a new data version, or training
    stays pinned to versions that are gone.  A rerun that reuses every partition must not."""
    from graph import dataset_assets, materialize

    from zarrfeed.resources import BuildOptions

    _, resources, instance = dagster_env
    discover(instance, resources, "ct")
    key = "train_1_a_1"
    assert build(resources, instance, "ct", key).success
    dataset = [a for a in dataset_assets() if a.key.path == ["ct_dataset"]]
    assert materialize(dataset, instance, resources=resources).success
    defs = dg.Definitions(
        assets=[*dataset, *family_assets("ct", resources)], resources=runtime(resources)
    )
    manifest_key = dg.AssetKey("ct_dataset")
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)

    assert build(resources, instance, "ct", key).success  # every partition reused
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    assert tick.get_num_requested(manifest_key) == 0

    store = resources["zarr_store"].store()
    before = store.commit_record("ct/windows", key)["version"]
    forced = {**resources, "build": BuildOptions(force=True)}
    assert build(forced, instance, "ct", key).success
    assert store.commit_record("ct/windows", key)["version"] != before
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    assert tick.get_num_requested(manifest_key) == 1


def test_every_setting_a_ct_stage_reads_makes_its_partitions_out_of_date():
    """A setting a stage's build or its blocking checks read is part of its fingerprint and
    code version: ``min_points`` decides which sparse partitions fail their check and so
    which scans enter the dataset, and a changed threshold must reach the committed
    partitions (the nightly rebuild, the UI's staleness)."""
    from zarrfeed.families.ct import CT, CT_SPARSE

    source = {"sha256": "0" * 64, "evidence": {}}
    before = CT.values({})
    after = CT.values({"min_points": before["min_points"] * 100})
    assert CT_SPARSE.code_version(after) != CT_SPARSE.code_version(before)
    old, new = CT.expected(before, "k", source), CT.expected(after, "k", source)
    assert [name for name in old if old[name] != new[name]] == ["ct_sparse"]


def _lost(chunk) -> str:
    chunk.unlink()
    return "stored data differs from its checksums"


def _garbled(chunk) -> str:
    chunk.write_bytes(b"garbage" * 100)
    return f"stored data does not read: {chunk}"


@pytest.mark.slow
@pytest.mark.parametrize("damage", [_lost, _garbled])
def test_damaged_stored_data_is_rebuilt_instead_of_reused(dagster_env, damage):
    """A chunk file lost behind the store's back reads as fill values, which can pass every
    check (a window of zeros is inside [0, 1]): the checksums recorded at the build catch it.
    A chunk overwritten with garbage fails to decode.  Either way the partition is rebuilt
    from its source, instead of reused with wrong values or failing every run until forced."""
    from pathlib import Path

    _, resources, instance = dagster_env
    discover(instance, resources, "ct")
    key = "train_1_a_1"
    assert build(resources, instance, "ct", key).success
    store = resources["zarr_store"].store()
    before = store.read_array("ct/windows", key, "lung")
    chunk = next(p for p in sorted(Path(store.version_path("ct/windows", key)).rglob("*"))
                 if p.is_file() and "/lung/c/" in str(p))  # fmt: skip
    why = damage(chunk)
    result = build(resources, instance, "ct", key)
    assert all(checks(result).values())
    [mat] = [m for m in result.asset_materializations_for_node("ct_derived")
             if m.asset_key == dg.AssetKey("ct_windows")]  # fmt: skip
    assert mat.metadata["reused"].value is False
    assert mat.metadata["why"].value.startswith(why)
    np.testing.assert_array_equal(store.read_array("ct/windows", key, "lung"), before)


DERIVED = ["ct_windows", "ct_sparse", "ct_patches"]


def mismatched(resources, key):
    """``zarrfeed verify``'s mismatches for partition ``key`` of every CT stage."""
    from zarrfeed.commands.verify import verify
    from zarrfeed.families.ct import CT

    specs = [(CT, spec) for spec in CT.assets]
    catalogs = {CT.name: resources["zarr_store"].catalog(CT.name)}
    found = verify(resources["zarr_store"].store(), specs, catalogs, key)
    return {f.asset: f.details for f in found if f.status == "MISMATCH"}


@pytest.mark.slow
def test_no_stage_builds_on_upstream_data_that_fails_its_checksums(dagster_env):
    """Two voxels of a committed HU chunk changed behind the store's back (the chunk still
    decodes): a forced run of the derived stages fails naming the HU partition and array
    instead of building windows from the corrupt volume; a plain build heals the HU, and
    the windows then are those of the healed HU, with nothing left mismatched."""
    import zarr
    from graph import materialize

    from zarrfeed.resources import BuildOptions
    from zarrfeed.transforms.ct import apply_windows

    _, resources, instance = dagster_env
    discover(instance, resources, "ct")
    key = "train_1_a_1"
    assert build(resources, instance, "ct", key).success
    store = resources["zarr_store"].store()
    windows = store.commit_record("ct/windows", key)["version"]
    hu = zarr.open_array(f"{store.version_path('ct/hu', key)}/hu", mode="r+")
    good = hu[...]
    hu[0, 0, :2] = good[0, 0, :2] + 74  # one chunk rewritten: it decodes, to other values
    assert mismatched(resources, key) == {
        "ct_hu": ["hu: content checksum differs from the one recorded at build"]
    }
    forced = {**resources, "build": BuildOptions(force=True)}
    result = materialize(
        family_assets("ct", forced),
        instance,
        partition_key=key,
        resources=forced,
        selection=DERIVED,
        raise_on_error=False,
    )
    assert not result.success
    assert f"ct_hu[{key}] array 'hu'" in failure(result)
    assert "differs from the checksum recorded" in failure(result)
    assert store.commit_record("ct/windows", key)["version"] == windows  # nothing built on it
    assert build(resources, instance, "ct", key).success  # heals the HU volume
    hu = store.read_array("ct/hu", key, "hu")
    np.testing.assert_array_equal(hu, good)
    expected = apply_windows(hu, ["lung", "bone"])
    for name, data in expected.items():
        np.testing.assert_array_equal(store.read_array("ct/windows", key, name), data)
    assert mismatched(resources, key) == {}


@pytest.mark.slow
def test_an_upstream_rebuilt_with_other_content_makes_what_was_built_from_it_stale(dagster_env):
    """Fingerprints hash inputs: an HU volume committed again with other values under the
    same fingerprint (a forced rebuild after a library changed its rounding) must make the
    windows, sparse indices and patches built from the one before stale — named by
    ``zarrfeed verify``, out of date for the nightly, and rebuilt by a plain build."""
    from zarrfeed.families.ct import CT, CT_HU, VERIFY_POINTS
    from zarrfeed.store.checksums import ATTR, array_checksum
    from zarrfeed.store.contract import CONTENT, content_digest
    from zarrfeed.transforms.ct import apply_windows

    _, resources, instance = dagster_env
    discover(instance, resources, "ct")
    key = "train_1_a_1"
    assert build(resources, instance, "ct", key).success
    store = resources["zarr_store"].store()
    assert mismatched(resources, key) == {}
    record = store.commit_record(CT_HU.path, key)
    hu = store.read_array(CT_HU.path, key, "hu")
    # The same inputs, other content: one voxel 1 HU up, away from the points its
    # matches_source check samples, so that the volume passes its checks and is kept.
    rng = np.random.default_rng(0)
    sampled = {tuple(p) for p in np.stack([rng.integers(0, n, VERIFY_POINTS) for n in hu.shape], 1)}
    voxel = next(v for v in np.ndindex(hu.shape) if v not in sampled and hu[v] < 3071)
    hu[voxel] += 1
    attrs = dict(record["attrs"])
    attrs[ATTR] = {"hu": array_checksum(hu)}
    attrs[CONTENT] = content_digest(attrs[ATTR])
    with store.write_partition(CT_HU.path, key, attrs) as w:
        w.write("hu", hu, dimension_names=CT_HU.array("hu").dims)
        w.checks = record["checks"]
    why = "built from another build of ct_hu than the one committed now"
    found = mismatched(resources, key)
    assert sorted(found) == sorted(DERIVED) and all(why in d[0] for d in found.values())
    index = resources["zarr_store"].catalog("ct").index()
    stale = CT.out_of_date(store, CT.values(resources["ct_settings"]), [key], index)
    assert stale == {key: "ct_windows: inputs, settings or code changed since the last build"}
    result = build(resources, instance, "ct", key)
    assert result.success
    [kept] = result.asset_materializations_for_node("ct_hu")
    assert kept.metadata["reused"].value is True  # the premise: the other content stays
    for mat in result.asset_materializations_for_node("ct_derived"):
        assert mat.metadata["reused"].value is False, mat.asset_key
    assert mismatched(resources, key) == {}
    lung = store.read_array("ct/windows", key, "lung")
    np.testing.assert_array_equal(lung, apply_windows(hu, ["lung"])["lung"])


@pytest.mark.slow
def test_a_patch_size_changed_for_one_scan_never_mixes_into_the_dataset(dagster_env):
    """Patch size changed to 32³ and one scan rebuilt: the reader takes one patch shape for
    every sample, so the dataset keeps the keys of one patch size and withholds the other,
    naming the setting and the stage to build again."""
    from graph import dataset_assets, materialize

    _, resources, instance = dagster_env
    discover(instance, resources, "ct")
    keys = ["train_1_a_1", "train_1_a_2"]
    for key in keys:
        assert build(resources, instance, "ct", key).success
    values = {**resources["ct_settings"].model_dump(), "patch_zyx": [32, 32, 32]}
    changed = {**resources, "ct_settings": CTSettings(**values)}
    assert build(changed, instance, "ct", keys[0]).success
    dataset = [a for a in dataset_assets() if a.key.path == ["ct_dataset"]]
    assert materialize(dataset, instance, resources=resources).success
    store = resources["zarr_store"].store()
    manifest = read_manifest(store, "ct")
    [kept] = manifest["keys"]
    [(withheld, why)] = manifest["failed"].items()
    assert {kept, withheld} == set(keys)
    assert "ct_patches was built with patch_zyx=" in why[0]
    assert why[0].endswith("build ct_patches again")
