"""A batched backfill run of a whole family, raw ingest included: its partitions build side
by side, each is recorded with its own data version and checks, a bad item fails alone, and
a rerun builds only what failed."""

import os
import shutil
import warnings

import dagster as dg
import pytest
from graph import FAMILIES, base_resources, definitions, discover, settings

from zarrfeed.assets import family_assets
from zarrfeed.assets.build import BATCH
from zarrfeed.assets.compat import DATA_VERSION_TAG, input_version_tag
from zarrfeed.components.deployment import ON_PARTIAL_FAILURE
from zarrfeed.families.ct import CT
from zarrfeed.jobs.build import build_job
from zarrfeed.resources import ZarrStoreResource
from zarrfeed.sources.raw import source_version

KEYS = ["train_1_a_1", "train_1_a_2", "train_2_a_1", "valid_1_a_1"]
BAD = "train_2_a_1"
RANGE = {"dagster/asset_partition_range_start": KEYS[0],
         "dagster/asset_partition_range_end": KEYS[-1]}  # fmt: skip
RAW = dg.AssetKey(CT.raw.asset)
STORE, SETTINGS = "ZF_TEST_BACKFILL_STORE", "ZF_TEST_BACKFILL_SETTINGS"


def ct_job() -> dg.JobDefinition:
    """The CT family's build job, in process, configured as the deployment's executor is
    for partial failures (``dg.materialize`` ignores executor settings)."""
    from zarrfeed.families.ct import CTSettings

    defs = dg.Definitions(
        assets=family_assets(CT, CTSettings.model_validate_json(os.environ[SETTINGS])),
        resources={**base_resources(), "zarr_store": ZarrStoreResource(url=os.environ[STORE])},
        jobs=[build_job(CT)],
        executor=dg.in_process_executor.configured(ON_PARTIAL_FAILURE),
    )
    return defs.resolve_job_def(CT.build_job)


def run(instance: dg.DagsterInstance, tags: dict[str, str]) -> dg.JobExecutionResult:
    job = dg.reconstructable(ct_job)
    # Dagster keeps the last definition loaded for an equal pointer: an earlier test's job
    # would build from that test's store.
    type(job).get_definition.cache_clear()
    type(job).get_repository_definition.cache_clear()
    with dg.execute_job(job, instance, tags=tags) as result:
        return result  # its events stay readable; its outputs are not read


def mats(result: dg.JobExecutionResult) -> dict[dg.AssetKey, list[dg.AssetMaterialization]]:
    out: dict[dg.AssetKey, list[dg.AssetMaterialization]] = {}
    for event in result.get_asset_materialization_events():
        m = event.event_specific_data.materialization
        out.setdefault(m.asset_key, []).append(m)
    return out


def step_failures(result: dg.JobExecutionResult) -> str:
    return "\n".join(
        e.event_specific_data.error.to_string() for e in result.all_events if e.is_step_failure
    )


@pytest.mark.slow
def test_backfill_run_builds_each_partition_on_its_own_and_a_bad_item_fails_alone(
    dagster_env, monkeypatch
):
    """Built in worker processes, as full-size scans are (these small ones would build in
    threads): the steps record what the workers committed."""
    raw, resources, instance = dagster_env
    monkeypatch.setattr("zarrfeed.batching.PROCESS_ITEM_BYTES", 0)
    monkeypatch.setenv(STORE, resources["zarr_store"].url)
    ct = CT.settings.model_validate(settings(resources, "ct"))
    monkeypatch.setenv(SETTINGS, ct.model_dump_json())
    assert discover(instance, resources, "ct")[: len(KEYS)] == KEYS
    store = resources["zarr_store"].store()
    bad = raw / "ct-rate/dataset/train_fixed/train_2/train_2_a/train_2_a_1.nii.gz"
    saved = bad.read_bytes()
    bad.write_bytes(b"truncated")
    discover(instance, resources, "ct")
    stored = [spec.name for spec in CT.assets]

    result = run(instance, RANGE)
    assert not result.success
    logged = [e.user_message for e in instance.all_logs(result.run_id)]
    assert sum("(worker processes)" in m for m in logged) == 2, logged  # HU, then the rest
    message = step_failures(result)
    assert "1 of 4 partitions failed" in message and "train_2_a_1.nii.gz" in message
    good = [k for k in KEYS if k != BAD]
    for spec in CT.assets:  # the others committed, every stage
        assert store.list_partitions(spec.path) == good, spec.name
    by_asset = mats(result)
    # Raw ingest hashed every item; the bad one is unreadable and fails on its own.
    assert sorted(m.partition for m in by_asset[RAW]) == good
    catalog = resources["zarr_store"].catalog("ct")
    for m in by_asset[RAW]:
        item = catalog.require(m.partition)  # with the hash its ingest recorded
        assert m.tags[DATA_VERSION_TAG] == source_version(item, item.sha256)
    assert len({m.tags[DATA_VERSION_TAG] for m in by_asset[RAW]}) == len(good)
    # One materialisation per committed partition, with that partition's own data version
    # (its committed version) and the data version of its own upstream partition.
    for spec in [CT.raw, *CT.assets]:
        key = dg.AssetKey(spec.asset if spec is CT.raw else spec.name)
        own = {c.partition for c in result.get_asset_check_evaluations()
               if c.asset_key == key and c.partition}  # fmt: skip
        assert own == set(good), key
    for spec in CT.assets:
        events = by_asset[dg.AssetKey(spec.name)]
        assert sorted(m.partition for m in events) == good, spec.name
        for m in events:
            record = store.commit_record(spec.path, m.partition)
            assert m.tags[DATA_VERSION_TAG] == record["version"]
            for up in CT.upstream_keys(spec):
                latest = instance.get_latest_data_version_record(
                    dg.AssetKey(up), partition_key=m.partition
                )
                want = latest.event_log_entry.tags[DATA_VERSION_TAG]
                assert m.tags[input_version_tag(dg.AssetKey(up))] == want
    assert set(stored) <= {k.path[-1] for k in by_asset}
    # What Dagster counts as failed (planned, not materialised) is the bad item alone: what
    # a backfill's retry of failed partitions runs again.
    events = instance.event_log_storage
    for name in [CT.raw.asset, *stored]:
        attempts = (
            events.get_latest_asset_partition_materialization_attempts_without_materializations
        )
        assert set(attempts(dg.AssetKey(name))) == {BAD}, name
        assert instance.get_materialized_partitions(dg.AssetKey(name)) == set(good), name

    # Fixed, the same range again: only the failed item is built; the others are reused.
    versions = {k: store.commit_record("ct/patches", k)["version"] for k in good}
    bad.write_bytes(saved)
    shutil.copystat(bad, bad)
    discover(instance, resources, "ct")
    again = run(instance, RANGE)
    assert again.success
    for spec in CT.assets:
        built = {m.partition: m.metadata["reused"].value
                 for m in mats(again)[dg.AssetKey(spec.name)]}  # fmt: skip
        assert built == {k: k != BAD for k in KEYS}, spec.name
        assert store.list_partitions(spec.path) == KEYS
    assert {k: store.commit_record("ct/patches", k)["version"] for k in good} == versions

    # A run of the one key alone is an ordinary one-partition run, reused as well.
    one = run(instance, {"dagster/partition": BAD})
    assert one.success
    assert all(m.metadata["reused"].value for ms in mats(one).values() for m in ms
               if m.asset_key != RAW)  # fmt: skip


def test_a_family_job_has_one_backfill_policy_its_raw_ingest_included(dagster_env):
    _, resources, _ = dagster_env
    for family in FAMILIES:
        defs = definitions(resources, family)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", ".*varying BackfillPolicies")
            defs.resolve_job_def(FAMILIES[family].build_job)
        assets = family_assets(FAMILIES[family], settings(resources, family))
        assert {a.backfill_policy for a in assets} == {BATCH}, family
    assert BATCH.max_partitions_per_run >= 2


@pytest.mark.slow
def test_a_batched_run_builds_nothing_on_an_item_that_fails_raw_ingests_readable_check(
    dagster_env, monkeypatch
):
    """A batched run's failed raw check is a warning for the range, never a pass for the
    item: a readable NIfTI with a one-voxel dimension gets no stored partition at all."""
    import nibabel as nib
    import numpy as np

    raw, resources, instance = dagster_env
    monkeypatch.setenv(STORE, resources["zarr_store"].url)
    monkeypatch.setenv(
        SETTINGS, CT.settings.model_validate(settings(resources, "ct")).model_dump_json()
    )
    assert discover(instance, resources, "ct")[: len(KEYS)] == KEYS
    flat_key = KEYS[1]
    flat = raw / f"ct-rate/dataset/train_fixed/train_1/train_1_a/{flat_key}.nii.gz"
    img = nib.load(flat)
    one_slice = np.asarray(img.dataobj.get_unscaled())[:, :, :1].copy()
    nib.save(nib.Nifti1Image(one_slice, img.affine, img.header), flat)
    discover(instance, resources, "ct")

    result = run(instance, RANGE)
    assert not result.success
    assert f"{flat_key}.nii.gz" in step_failures(result)
    store = resources["zarr_store"].store()
    others = [k for k in KEYS if k != flat_key]
    for spec in CT.assets:
        assert store.list_partitions(spec.path) == others, spec.name
    checks = {c.partition: c.passed for c in result.get_asset_check_evaluations()
              if c.asset_key == RAW and c.partition}  # fmt: skip
    assert checks == {k: k != flat_key for k in KEYS}


def test_an_interrupted_batch_starts_no_more_partitions_and_keeps_those_that_finished():
    """A cancelled run (an interrupt in the step's thread while a partition builds) stops the
    batch at once: the queued partitions never start, the one building is not waited for, and
    the ones that finished are there to be recorded."""
    import threading

    from zarrfeed.assets.build import Built, build_range

    started: list[str] = []
    k1_building, released = threading.Event(), threading.Event()

    def build(key: str):
        started.append(key)
        if key == "k1":  # still building when the run is cancelled
            k1_building.set()
            released.wait(timeout=10)
        yield RAW, Built({"key": key})

    def finished(key: str) -> None:  # the step's thread, recording k0: the cancel comes
        assert k1_building.wait(timeout=10)
        raise KeyboardInterrupt

    done: dict = {}
    errors: dict = {}
    keys = [f"k{i}" for i in range(10)]
    with pytest.raises(KeyboardInterrupt):
        build_range(keys, build, 1, done, errors, finished)
    released.set()
    assert started == ["k0", "k1"]
    assert list(done) == ["k0"] and done["k0"][RAW].metadata == {"key": "k0"}
    assert errors == {}


def test_a_batch_hands_each_finished_partition_over_while_the_others_build():
    """The step's thread gets each partition as soon as it finishes (to record it), failed
    ones included, while the next partition is still building."""
    import threading

    from zarrfeed.assets.build import Built, build_range

    handed = threading.Event()
    seen_while_building: list[bool] = []
    calls: list[tuple[str, bool, str | None]] = []

    def build(key: str):
        if key == "k1":  # builds until another partition has been handed over (or gives up)
            seen_while_building.append(handed.wait(timeout=10))
        if key == "k2":
            raise ValueError("bad item")
        yield RAW, Built({"key": key})

    done: dict = {}
    errors: dict = {}

    def finished(key: str) -> None:
        calls.append((key, threading.current_thread() is threading.main_thread(), errors.get(key)))
        handed.set()

    build_range(["k0", "k1", "k2"], build, 2, done, errors, finished)
    assert seen_while_building == [True]
    assert sorted(calls) == [("k0", True, None), ("k1", True, None), ("k2", True, "bad item")]
    assert set(done) == {"k0", "k1", "k2"}
