"""The store on a real S3 server (SeaweedFS on 127.0.0.1, one per module, stopped by PID):
every store feature, a commit killed at every step, concurrent writers; and faults injected
by moto's S3 server (500s, throttling, cut connections) that end in a retried or a cleanly
failed partition, never a half one."""

import multiprocessing
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import s3fs
import s3server

# The store tests of test_store.py, run again here on the S3 store of this module's `store`.
from test_store import (  # noqa: F401
    die_at,
    old_or_new_whole,
    test_a_reader_pinned_to_a_replaced_version_fails_loudly,
    test_commit_record_is_json_with_stored_bytes,
    test_failed_write_leaves_nothing_and_keeps_the_committed_version,
    test_force_rewrite_replaces_arrays_and_attrs,
    test_hostile_keys_are_refused,
    test_round_trip_provenance_and_manifest,
    trace_commit,
    versions,
    write,
)

from zarrfeed.datasets import build_manifest, collect, read_manifest
from zarrfeed.errors import StoreError
from zarrfeed.store import ObjectBackend, ZarrStore
from zarrfeed.store.backends import redact
from zarrfeed.store.records import summarise

BUCKET = "zarrfeed-test"


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    with s3server.seaweedfs(tmp_path_factory.mktemp("weed")) as server:
        server.make_bucket(BUCKET)
        yield server


def values_of(store: ZarrStore, key: str) -> list[float]:
    """The distinct values of a written partition's ``lung`` array (one, when whole)."""
    return np.unique(store.read_array("ct/windows", key, "lung")).tolist()


@pytest.fixture
def store(weed) -> ZarrStore:
    """A fresh prefix of the bucket for each test."""
    return ZarrStore(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", weed.storage_options())


def test_identity_names_the_server_never_the_credentials(store, weed):
    assert store.url.startswith(f"s3://{BUCKET}/")
    assert store.identity == f"{store.url}|{weed.endpoint}"
    for text in (store.url, store.identity, repr(store)):
        assert weed.secret not in text and weed.key not in text


def test_wrong_credentials_fail_naming_the_object_but_not_the_secret(weed):
    wrong = {**weed.storage_options(), "secret": "not-the-secret-at-all"}
    store = ZarrStore(f"s3://{BUCKET}/denied", wrong)
    with pytest.raises(StoreError) as err:
        store.commit_record("ct/hu", "scan_1")
    text = str(err.value)
    assert f"s3://{BUCKET}/denied/.zarrfeed/commits/ct/hu/scan_1.json" in text
    assert weed.endpoint in text and "not-the-secret-at-all" not in text
    assert "refused these credentials" in text  # the server said so: the one hint that fits


def test_manifests_reread_only_changed_records(store):
    for key, value in (("scan_1", 0.5), ("scan_2", 0.25)):
        write(store, key, value)
    first = build_manifest(store, "ct/windows")
    reads = []
    original = ObjectBackend.read_many

    def counting(self, paths, threads=8):
        reads.extend(paths)
        return original(self, paths, threads)

    ObjectBackend.read_many = counting
    try:
        assert build_manifest(store, "ct/windows") == first  # nothing changed: no record read
        assert reads == []
        write(store, "scan_2", 0.75)
        summaries = store.record_summaries("ct/windows")
    finally:
        ObjectBackend.read_many = original
    assert [p.rsplit("/", 1)[-1] for p in reads] == ["scan_2.json"]
    record = store.commit_record("ct/windows", "scan_2")
    assert {k: v for k, v in summaries["scan_2"].items() if k != "stamp"} == summarise(record)


def test_an_array_read_is_a_get_per_object_and_threads_share_one_client(store, monkeypatch):
    data = np.arange(20 * 30 * 40, dtype=np.float32).reshape(20, 30, 40)
    with store.write_partition("ct/windows", "scan_1", {}) as w:
        w.write("lung", data, chunks=(10, 10, 10))  # 24 chunk objects
    calls: list[tuple[str, int]] = []
    real = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        calls.append((method, id(self)))
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    store.tier = None  # every chunk from the bucket
    with ThreadPoolExecutor(4) as pool:
        read = list(pool.map(lambda _: store.read_array("ct/windows", "scan_1", "lung"), range(4)))
    for found in read:
        np.testing.assert_array_equal(found, data)
    # Per read: the commit record (which holds the array's zarr.json), 24 chunks; no HEAD
    # before a GET; one LIST of the version (kept by the store; reads side by side may each
    # make one).
    methods = [m for m, _ in calls]
    assert methods.count("get_object") == 4 * (1 + 24)
    assert 1 <= methods.count("list_objects_v2") <= 4
    assert len(methods) == methods.count("get_object") + methods.count("list_objects_v2")
    assert {fs for _, fs in calls} == {id(store.backend.fs)}  # one client, shared


def test_a_chunk_never_written_costs_no_request_and_a_lost_one_fails(store, monkeypatch):
    data = np.zeros((20, 20), np.float32)
    data[:10, :10] = 1  # one chunk of four written: the others hold only the fill value
    with store.write_partition("ct/windows", "scan_1", {}) as w:
        w.write("lung", data, chunks=(10, 10))
    store.tier = None
    calls: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        calls.append(method)
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    np.testing.assert_array_equal(store.read_array("ct/windows", "scan_1", "lung"), data)
    assert sorted(calls) == ["get_object"] * 2 + ["list_objects_v2"]  # record, chunk
    calls.clear()
    np.testing.assert_array_equal(store.read_array("ct/windows", "scan_1", "lung"), data)
    assert calls == ["get_object"] * 2  # the version's listing is kept
    # A listed chunk that is gone is an error, never fill values.
    store.backend.remove(f"{store.version_path('ct/windows', 'scan_1')}/lung/c/0/0")
    with pytest.raises(StoreError, match="lung/c/0/0: this chunk of a committed version"):
        store.read_array("ct/windows", "scan_1", "lung")


def test_a_listing_short_of_the_stored_bytes_is_not_trusted(store, monkeypatch):
    data = np.ones((20, 20), np.float32)
    with store.write_partition("ct/windows", "scan_1", {}) as w:
        w.write("lung", data, chunks=(10, 10))
    store.tier = None
    real = store.backend.sizes
    monkeypatch.setattr(store.backend, "sizes", lambda p: dict(list(real(p).items())[1:]))
    np.testing.assert_array_equal(store.read_array("ct/windows", "scan_1", "lung"), data)


def _die_at(url: str, options: dict, index: int, after: bool, value: float) -> None:
    die_at(ObjectBackend, index, after)
    write(ZarrStore(url, options), "scan_1", value)
    os._exit(0)


@pytest.mark.slow
def test_a_commit_killed_at_any_step_leaves_the_old_or_the_new_version_whole(store, weed):
    write(store, "scan_1", 0.5)
    probe = ZarrStore(f"{store.url}-probe", weed.storage_options())
    write(probe, "scan_1", 0.5)  # a rewrite, as below
    steps = trace_commit(probe, 0.25, ObjectBackend)
    assert "write_atomic" in steps and steps.count("put_many") >= 2
    spawn = multiprocessing.get_context("spawn")  # a fresh client in every writer
    outcomes = set()
    for index in range(len(steps)):
        for after in (False, True):
            value = 0.25 if index % 2 else 0.75
            args = (store.url, weed.storage_options(), index, after, value)
            proc = spawn.Process(target=_die_at, args=args)
            proc.start()
            proc.join(120)
            assert proc.exitcode == 9, (index, after, steps)
            reader = ZarrStore(store.url, weed.storage_options())
            outcomes.add(old_or_new_whole(reader, (index, after, steps)))
    assert outcomes == {False, True}


def _writer(url: str, options: dict, key: str, value: float, rounds: int) -> None:
    store = ZarrStore(url, options)
    for _ in range(rounds):
        write(store, key, value)


@pytest.mark.slow
def test_concurrent_writers_of_one_partition_end_with_one_complete_version(store, weed):
    spawn = multiprocessing.get_context("spawn")
    values = (0.25, 0.75)
    procs = [
        spawn.Process(target=_writer, args=(store.url, weed.storage_options(), "scan_1", v, 4))
        for v in values
    ]
    procs += [  # and writers of other partitions, alongside
        spawn.Process(target=_writer, args=(store.url, weed.storage_options(), f"other_{i}", i, 2))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0
    lung = values_of(store, "scan_1")
    assert len(lung) == 1 and lung[0] in values
    collect(store, older_than_s=0)
    assert versions(store, "scan_1") == [store.commit_record("ct/windows", "scan_1")["version"]]
    assert store.list_partitions("ct/windows") == ["other_0", "other_1", "scan_1"]
    for i in range(2):
        assert values_of(store, f"other_{i}") == [i]


# -- faults (moto) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    with s3server.moto(tmp_path_factory.mktemp("moto")) as server:
        server.make_bucket(BUCKET)
        yield server


def moto_store(server, attempts: int = 4) -> ZarrStore:
    # Few, fast retries keep a fault that outlasts them short.
    retries = {"retries": {"max_attempts": attempts, "mode": "standard"}}
    options = server.storage_options(config_kwargs=retries)
    return ZarrStore(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", options)


@pytest.mark.parametrize(
    ("method", "path", "fault"),
    [
        ("PUT", "/c/", {"status": 500}),  # a chunk upload
        ("PUT", "/c/", {"status": 503}),  # throttled: SlowDown
        ("PUT", "/c/", {"cut": "before"}),
        ("PUT", "/.zarrfeed/commits/", {"status": 500}),  # the commit itself
        ("PUT", "/.zarrfeed/commits/", {"cut": "after"}),  # applied, answer lost
        ("GET", "/c/", {"status": 503}),
        ("GET", "/c/", {"cut": "before"}),
    ],
)
def test_a_passing_fault_is_retried(faulty, method, path, fault):
    store = moto_store(faulty)
    write(store, "scan_1", 0.5)
    faulty.inject(method=method, path=path, times=2, **fault)
    write(store, "scan_1", 0.25)
    assert values_of(store, "scan_1") == [0.25]
    assert faulty.clear_faults()["served"] == 2
    collect(store, older_than_s=0)  # the replaced version, which nothing retains
    assert versions(store, "scan_1") == [store.commit_record("ct/windows", "scan_1")["version"]]


@pytest.mark.parametrize(
    ("path", "fault"),
    [
        ("/c/", {"status": 500}),
        ("/c/", {"cut": "before"}),
        ("/.zarrfeed/commits/", {"status": 500}),
        ("/.zarrfeed/commits/", {"cut": "before"}),
    ],
)
def test_a_lasting_fault_fails_the_partition_cleanly(faulty, path, fault):
    store = moto_store(faulty, attempts=2)
    write(store, "scan_1", 0.5)
    before = store.commit_record("ct/windows", "scan_1")
    faulty.inject(method="PUT", path=path, times=1000, **fault)
    try:
        with pytest.raises(StoreError) as err:
            write(store, "scan_1", 0.25)
    finally:
        faulty.clear_faults()
    text = str(err.value)
    assert "could not write" in text and "retries included" in text and store.url in text
    assert faulty.secret not in text and faulty.key not in text
    assert "credentials" not in text  # a server error or a cut connection: not a login
    assert store.commit_record("ct/windows", "scan_1") == before  # the old version, whole
    assert values_of(store, "scan_1") == [0.5]
    assert versions(store, "scan_1") == [before["version"]]  # the new one was removed


# -- the demo's graph in a bucket ---------------------------------------------------------


@pytest.fixture
def s3_env(weed, tmp_path, sample_dir, monkeypatch):
    yield from graph_env(weed, tmp_path, sample_dir, monkeypatch)


def graph_env(server, tmp_path, sample_dir, monkeypatch):
    """(raw folder, resources, instance) like ``dagster_env``, with the store in the bucket
    and the server and credentials given only by the standard AWS variables — what
    ``zarrfeed.definitions`` passes is the URL alone."""
    import shutil

    import dagster as dg
    from graph import base_resources

    from zarrfeed.families.ct import CTSettings
    from zarrfeed.resources import RawFolderResource, ZarrStoreResource

    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    raw = tmp_path / "raw"
    shutil.copytree(sample_dir, raw)
    resources = {
        **base_resources(),
        "zarr_store": ZarrStoreResource(url=f"s3://{BUCKET}/graph-{uuid.uuid4().hex[:8]}"),
        "raw": RawFolderResource(root=str(raw)),
        "ct_settings": CTSettings(
            spacing_zyx_mm=[5.0, 3.0, 3.0], windows=["lung", "bone"], sparse_grid=16
        ),
    }
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        yield raw, resources, instance


@pytest.mark.slow
def test_the_ct_graph_builds_into_a_bucket_and_trains_from_it(s3_env, weed):
    import dagster as dg
    from graph import build, checks, discover

    from zarrfeed.assets.datasets import dataset_asset
    from zarrfeed.families.ct import CT
    from zarrfeed.families.ct.datasets import CTPatchDataset
    from zarrfeed.resources import BuildOptions
    from zarrfeed.training import make_loader

    _, resources, instance = s3_env
    store = resources["zarr_store"].store()
    assert discover(instance, resources, "ct") == CT_KEYS
    for key in CT_KEYS[:2]:
        assert all(checks(build(resources, instance, "ct", key)).values())
    version = store.commit_record("ct/windows", CT_KEYS[0])["version"]
    build(resources, instance, "ct", CT_KEYS[0])  # unchanged: reused, re-checked
    assert store.commit_record("ct/windows", CT_KEYS[0])["version"] == version
    forced = {**resources, "build": BuildOptions(force=True)}
    assert all(checks(build(forced, instance, "ct", CT_KEYS[0])).values())
    assert store.commit_record("ct/windows", CT_KEYS[0])["version"] != version
    current = store.commit_record("ct/windows", CT_KEYS[0])["version"]
    assert versions(store, CT_KEYS[0], "ct/windows") == sorted([version, current])
    collect(store, older_than_s=0)  # no dataset version names the replaced one
    assert versions(store, CT_KEYS[0], "ct/windows") == [current]  # and no copy was made

    ct_dataset = dg.materialize([dataset_asset(CT)], resources=resources, instance=instance)
    assert all(checks(ct_dataset).values())
    manifest = read_manifest(store, "ct")
    assert manifest["keys"] == CT_KEYS[:2] and manifest["incomplete"] == []
    assert manifest["store"] == store.url

    dataset = CTPatchDataset(store, window="lung", cache_gb=0.05)
    loader, _ = make_loader(dataset, batch_size=4, workers=1, log=None)
    batch = next(iter(loader))
    assert batch["image"].shape[0] == 4 and batch["image"].dtype.is_floating_point

    # No secret anywhere: the event log (metadata, logs, errors), the store's JSON objects.
    events = [str(e) for run in instance.get_runs() for e in instance.all_logs(run.run_id)]
    texts = [
        *events,
        *(store.backend.read(p).decode(errors="replace") for p in _json_objects(store)),
    ]
    assert events and all(weed.secret not in t and weed.key not in t for t in texts)
    assert dg.AssetKey("ct_dataset") in instance.get_asset_keys()


def _json_objects(store: ZarrStore) -> list[str]:
    return [p for p in store.backend.fs.find(store.root) if p.endswith(".json")]


SETTLE_S = 5  # beyond the retries of two attempts (AWS_MAX_ATTEMPTS) with their backoff
CT_KEYS = ["train_1_a_1", "train_1_a_2", "train_2_a_1", "valid_1_a_1"]


@pytest.mark.slow
def test_a_partition_run_through_a_lasting_fault_fails_cleanly_and_its_retry_commits(
    faulty, tmp_path, sample_dir, monkeypatch
):
    from graph import build, checks, discover, failure

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # the standard variable: a short test
    env = graph_env(faulty, tmp_path, sample_dir, monkeypatch)
    _, resources, instance = next(env)
    store = resources["zarr_store"].store()
    discover(instance, resources, "ct")
    faulty.inject(method="PUT", path="/ct/hu/", status=500, times=10_000)  # every HU upload
    try:
        result = build(resources, instance, "ct", CT_KEYS[0], raise_on_error=False)
        # The fault lasts a while after the step fails: zarr's other chunk uploads of the
        # failed write may still be retrying then, and one that lands once the fault is gone
        # leaves an object in a version already discarded (no record names it; the store's
        # collection removes it) -- a lasting fault fails them too.
        time.sleep(SETTLE_S)
    finally:
        faulty.clear_faults()
    text = failure(result)
    assert not result.success and "could not write" in text and "/ct/hu/" in text
    assert faulty.secret not in text and faulty.key not in text
    assert store.list_partitions("ct/hu") == []  # nothing half-committed
    assert versions(store, CT_KEYS[0], "ct/hu") == []  # and the failed version removed
    retried = build(resources, instance, "ct", CT_KEYS[0])  # the retry, fault gone
    assert retried.success and all(checks(retried).values())
    env.close()


def test_an_endpoint_with_a_password_never_shows_it(monkeypatch):
    """``http://user:password@host`` endpoints work with some gateways: the password stays
    out of the identity (which keys caches) and out of every error."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    options = {"endpoint_url": "http://admin:TopSecretPw@127.0.0.1:9", "key": "k", "secret": "s"}
    store = ZarrStore(f"s3://{BUCKET}/closed", options)
    assert store.identity == f"s3://{BUCKET}/closed|http://127.0.0.1:9"
    with pytest.raises(StoreError) as err:
        store.commit_record("ct/hu", "scan_1")
    assert "127.0.0.1:9" in str(err.value) and "TopSecretPw" not in str(err.value)
    # urllib splits the userinfo at the last "@": an unescaped "@" in a password too.
    assert redact("http://admin:p@ss@host:9000/x") == "http://***@host:9000/x"
