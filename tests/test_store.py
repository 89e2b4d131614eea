import errno
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from zarrfeed.datasets import build_manifest, collect, consolidate, read_manifest, write_dataset
from zarrfeed.errors import InvalidKeyError, StoreError
from zarrfeed.store import (
    ChunkedArray,
    LocalBackend,
    ZarrStore,
    arrays,
    chunks_for,
    commits,
    compressors_for,
    provenance,
    sanitise_key,
)
from zarrfeed.store.chunkio import ZEROED_BYTES, BloscLayout, write_from
from zarrfeed.store.commits import version_time


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        yield ZarrStore(tmp_path / "s.zarr")
        return
    url = f"memory://{tmp_path.name}/s.zarr"
    yield ZarrStore(url)
    import fsspec

    memory = fsspec.filesystem("memory")
    if memory.exists(f"/{tmp_path.name}"):
        memory.rm(f"/{tmp_path.name}", recursive=True)


def write(store, key, value, source="raw.nii.gz"):
    with store.write_partition(
        "ct/windows", key, provenance(source, "ab" * 32, "1", {"w": "lung"})
    ) as w:
        w.write("lung", np.full((20, 30, 40), value, dtype=np.float16))
        w.write("coords", np.arange(300, dtype=np.uint16).reshape(100, 3), read="rows")


def test_round_trip_provenance_and_manifest(store):
    write(store, "scan_1", 0.5)
    write(store, "scan_2", 0.25)
    assert store.list_partitions("ct/windows") == ["scan_1", "scan_2"]
    group = store.open_partition("ct/windows", "scan_2")
    assert group.attrs["source_sha256"] == "ab" * 32 and group.attrs["params"] == {"w": "lung"}
    np.testing.assert_array_equal(store.open_array("ct/windows", "scan_2", "lung")[:], 0.25)
    manifest = build_manifest(store, "ct/windows", split="train")
    assert write_dataset(store, "ct", ["ct/windows"]) == read_manifest(store, "ct")
    assert manifest["total_partitions"] == 2 and manifest["split"] == "train"
    assert manifest["arrays"]["lung"] == {
        "dtypes": ["float16"],
        "shapes": [[20, 30, 40]],
        "nbytes": 2 * 20 * 30 * 40 * 2,
    }
    assert manifest["partitions"][0]["source"] == "raw.nii.gz"
    assert 0 < manifest["total_stored_bytes"] < manifest["total_nbytes"]
    with pytest.raises(StoreError, match="no array 'bone'"):
        store.open_array("ct/windows", "scan_1", "bone")
    with pytest.raises(StoreError, match="no committed partition 'scan_3'"):
        store.open_partition("ct/windows", "scan_3")


def test_non_finite_attrs_survive_the_fast_json_path(store):
    # Records are written by json.dumps, which writes NaN; the fast parser refuses it and
    # must hand the record to the standard library, never drop or change the value.
    with store.write_partition("ct/windows", "scan_1", {"hu_min": float("nan")}) as w:
        w.write("lung", np.zeros((4, 4, 4), dtype=np.float16))
    assert np.isnan(store.commit_record("ct/windows", "scan_1")["attrs"]["hu_min"])
    assert store.commit_records("ct/windows", ["scan_1"])["scan_1"]["key"] == "scan_1"
    assert build_manifest(store, "ct/windows")["total_partitions"] == 1


def test_failed_write_leaves_nothing_and_keeps_the_committed_version(store):
    write(store, "scan_1", 0.5)
    with (
        pytest.raises(RuntimeError, match="boom"),
        store.write_partition("ct/windows", "scan_1") as w,
    ):
        w.write("lung", np.zeros((20, 30, 40), dtype=np.float16))
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError), store.write_partition("ct/windows", "scan_9") as w:
        w.write("lung", np.zeros((2, 3, 4), dtype=np.float16))
        raise RuntimeError("boom")
    assert store.list_partitions("ct/windows") == ["scan_1"]
    np.testing.assert_array_equal(store.open_array("ct/windows", "scan_1", "lung")[:], 0.5)
    committed = store.commit_record("ct/windows", "scan_1")["version"]
    assert versions(store, "scan_1") == [committed]  # the failed version is gone
    assert versions(store, "scan_9") == []


def versions(store, key, asset="ct/windows"):
    names = store.backend.list_dir(store.path(asset, key))
    return sorted(n for n in names if version_time(n) is not None)


def test_force_rewrite_replaces_arrays_and_attrs(store):
    write(store, "scan_1", 0.5, source="old")
    with store.write_partition("ct/windows", "scan_1", {"source": "new"}) as w:
        w.write("lung", np.ones((5, 5, 5), dtype=np.float16))
    group = store.open_partition("ct/windows", "scan_1")
    assert group.attrs["source"] == "new" and sorted(group.array_keys()) == ["lung"]
    record = store.commit_record("ct/windows", "scan_1")
    assert record["arrays"]["lung"]["shape"] == [5, 5, 5]
    # The replaced version stays until a collection finds that nothing retains it.
    assert record["version"] in versions(store, "scan_1") and len(versions(store, "scan_1")) == 2
    collect(store, older_than_s=0)
    assert versions(store, "scan_1") == [record["version"]]


def test_a_reader_pinned_to_a_replaced_version_fails_loudly(store):
    write(store, "scan_1", 0.5)
    old = store.commit_record("ct/windows", "scan_1")["version"]
    pinned = store.chunked("ct/windows", "scan_1", "lung", old)
    write(store, "scan_1", 0.25)
    assert old in versions(store, "scan_1")  # kept until collected
    collect(store, older_than_s=0)  # no dataset version or lease names it
    with pytest.raises(StoreError, match="removed while being read"):
        pinned.read()  # its chunks are gone: never silently the fill value
    with pytest.raises(StoreError, match="collected"):
        store.open_partition("ct/windows", "scan_1", old)
    np.testing.assert_array_equal(store.read_array("ct/windows", "scan_1", "lung"), 0.25)


def test_a_partition_read_while_it_is_rebuilt_fails_loudly_and_never_mixes_builds(store):
    def build(value: int) -> None:
        with store.write_partition("ct/table", "all", {"build": value}) as w:
            w.write("offsets", np.full(5, value, np.int64))
            w.write("origins", np.full((4, 3), value, np.uint16))

    real = store.read_array

    def read_racing(rebuild: int, collecting: bool) -> tuple[dict, dict]:
        def racing(asset, key, name, version=None):
            if name == "origins":  # a rebuild commits between the partition's two arrays
                build(rebuild)
                if collecting:  # … and a collection with no grace removes the version being read
                    collect(store, older_than_s=0)
            return real(asset, key, name, version)

        store.read_array = racing
        try:
            return store.read_partition("ct/table", "all", ["offsets", "origins"])
        finally:
            store.read_array = real

    build(1)
    with pytest.raises(StoreError, match=r"is gone from .* rebuilt or deleted since"):
        read_racing(2, collecting=True)
    # Not collected, the version being read stays whole: one build, never two.
    arrays, attrs = read_racing(3, collecting=False)
    assert attrs["build"] == 2 and (arrays["offsets"] == 2).all() and (arrays["origins"] == 2).all()
    arrays, attrs = store.read_partition("ct/table", "all", ["offsets", "origins"])
    assert attrs["build"] == 3 and (arrays["offsets"] == 3).all() and (arrays["origins"] == 3).all()


def test_a_damaged_commit_record_or_manifest_is_named(store):
    write(store, "scan_1", 0.5)
    write_dataset(store, "ct", ["ct/windows"])
    record = store.record_path("ct/windows", "scan_1")
    manifest = store.meta_path("manifests", "ct.json")
    for path in (record, manifest):
        store.backend.write_atomic(path, b'{"version": "v1", "arr')  # cut short
    for read in (
        lambda: store.commit_record("ct/windows", "scan_1"),
        lambda: store.commit_records("ct/windows", ["scan_1"]),
        lambda: read_manifest(store, "ct"),
    ):
        with pytest.raises(StoreError, match=r"not a readable JSON document.*damaged"):
            read()


def test_a_version_made_durable_too_late_is_not_committed_and_the_old_one_stays(tmp_path):
    """Unnamed versions older than the grace period are swept by other writers: a version
    whose data became durable only near that age is refused before its record names it."""
    store = ZarrStore(tmp_path / "s.zarr")
    write(store, "scan_1", 0.5)
    real = store.backend.persist

    def slow(folder: str) -> None:
        time.sleep(1.2)
        real(folder)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(commits, "VERSION_GRACE_S", commits.MARGIN_S + 1.0)
        mp.setattr(store.backend, "persist", slow)
        with pytest.raises(StoreError, match="too close to the"):
            write(store, "scan_1", 0.25)
    np.testing.assert_array_equal(store.read_array("ct/windows", "scan_1", "lung"), 0.5)
    versions = [
        n for n in store.backend.list_dir(store.path("ct/windows", "scan_1")) if version_time(n)
    ]
    assert len(versions) == 1  # the late one is gone


CRASH = """
import os, sys, numpy as np
from zarrfeed.store import ZarrStore
store = ZarrStore(sys.argv[1])
with store.write_partition("ct/windows", "scan_2") as w:
    w.write("lung", np.zeros((64, 64, 64), dtype=np.float16))
    os._exit(9)  # the process dies mid-partition: no cleanup, no exception handling
"""


def test_a_crashed_writer_leaves_no_partition(tmp_path):
    store = ZarrStore(tmp_path / "s.zarr")
    write(store, "scan_1", 0.5)
    proc = subprocess.run([sys.executable, "-c", CRASH, store.url], capture_output=True)
    assert proc.returncode == 9
    assert store.list_partitions("ct/windows") == ["scan_1"]
    assert not store.has_partition("ct/windows", "scan_2")
    assert len(versions(store, "scan_2")) == 1  # the debris is named by no record …
    assert collect(store).removed == 0  # … and kept while a writer could still be at work
    assert collect(store, older_than_s=0).removed == 1  # … then collected
    assert versions(store, "scan_2") == [] and len(versions(store, "scan_1")) == 1


CALLS = ("put_many", "persist", "write_atomic", "remove", "remove_tree")


def trace_commit(store, value, cls=LocalBackend):
    """The backend calls (of backend class ``cls``) that rewriting scan_1 makes, in order."""
    seen = []
    originals = {name: getattr(cls, name) for name in CALLS}

    def spy(name):
        def call(self, *args, **kwargs):
            seen.append(name)
            return originals[name](self, *args, **kwargs)

        return call

    try:
        for name in CALLS:
            setattr(cls, name, spy(name))
        write(store, "scan_1", value)
    finally:
        for name, fn in originals.items():
            setattr(cls, name, fn)
    return seen


def die_at(cls, index: int, after: bool) -> None:
    """Make this process die just before (or after) its backend call ``index``: no clean-up,
    no exception handling.  For a child process only."""
    count = [0]
    originals = {name: getattr(cls, name) for name in CALLS}

    def dying(name):
        def call(self, *args, **kwargs):
            hit = count[0] == index
            count[0] += 1
            if hit and not after:
                os._exit(9)
            result = originals[name](self, *args, **kwargs)
            if hit:
                os._exit(9)
            return result

        return call

    for name in CALLS:
        setattr(cls, name, dying(name))


def test_every_file_and_folder_of_a_version_is_on_disk_before_its_record(tmp_path, monkeypatch):
    """A power loss after the commit must not keep the record and lose a chunk file (which
    would read as fill values): every file and folder of the version is fsynced first."""
    synced, order = set(), []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    def spy_replace(src, dst):
        order.append((str(dst), set(synced)))
        return replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    store = ZarrStore(tmp_path / "s.zarr")
    write(store, "scan_1", 0.5)
    version = Path(store.version_path("ct/windows", "scan_1"))
    on_disk = {str(p) for p in version.rglob("*")} | {str(version), str(version.parent)}
    before = next(seen for dst, seen in order if dst.endswith("scan_1.json"))
    assert len(on_disk) > 6 and on_disk <= before


def test_a_write_back_error_fails_the_commit_naming_the_file(tmp_path, monkeypatch):
    store = ZarrStore(tmp_path / "s.zarr")
    write(store, "scan_1", 0.5)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"fsync failed: No space left on device: .*s\.zarr/ct/"):
        write(store, "scan_1", 0.25)
    monkeypatch.undo()
    np.testing.assert_array_equal(store.open_array("ct/windows", "scan_1", "lung")[:], 0.5)
    assert len(versions(store, "scan_1")) == 1  # the new version was discarded


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_names_the_path_and_the_free_space_not_credentials(tmp_path, monkeypatch, code):
    store = ZarrStore(tmp_path / "s.zarr")

    async def full(self, key, value, *args, **kwargs):
        raise OSError(code, os.strerror(code), f"{self.root}/{key}")

    monkeypatch.setattr(zarr.storage.LocalStore, "set", full)
    with pytest.raises(StoreError) as err:
        write(store, "scan_1", 0.5)
    text = str(err.value)
    assert f"could not write {tmp_path / 's.zarr'}/ct/windows/" in text, text
    assert f"({errno.errorcode[code]}); the file system of {tmp_path / 's.zarr'}" in text
    assert re.search(r"has \d+\.\d\d GB free of \d+\.\d\d GB", text), text
    assert "credentials" not in text and "reachable" not in text


def test_no_permission_or_a_read_only_disk_names_the_mode_and_owner(tmp_path):
    """Tests run as root, which a 0500 folder does not stop: the error is raised by hand."""
    backend, folder = LocalBackend(tmp_path / "s.zarr"), tmp_path / "s.zarr"
    folder.mkdir(mode=0o500)
    target = f"{folder}/ct/windows/zarr.json"
    denied = backend.failure("write", target, PermissionError(errno.EACCES, "denied", target))
    text = str(denied)
    assert text.startswith(f"could not write {target}: permission denied (EACCES); {folder} is ")
    assert "mode dr-x------ (0500), owned by " in text and "this process runs as " in text
    assert "credentials" not in text
    locked = backend.failure("write", target, OSError(errno.EROFS, "read-only", target))
    assert f"read-only file system (EROFS) at {folder}" in str(locked)
    other = str(backend.failure("read", target, OSError(errno.EIO, "I/O error", target)))
    assert "EIO" not in other and "I/O error" in other and "retries" not in other
    assert "credentials" not in other


def test_a_commit_killed_at_any_step_leaves_the_old_or_the_new_version_whole(tmp_path):
    store = ZarrStore(tmp_path / "s.zarr")
    write(store, "scan_1", 0.5)
    probe = ZarrStore(tmp_path / "probe.zarr")
    write(probe, "scan_1", 0.5)  # a rewrite, as below
    steps = trace_commit(probe, 0.25)
    assert steps.count("put_many") >= 2 and steps.index("persist") < steps.index("write_atomic")
    outcomes = set()
    for index in range(len(steps)):
        for after in (False, True):
            pid = os.fork()
            if pid == 0:  # the writer: dies just before (or after) backend call ``index``
                die_at(LocalBackend, index, after)
                write(ZarrStore(store.url), "scan_1", 0.25 if index % 2 else 0.75)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 9, (index, after)
            outcomes.add(old_or_new_whole(ZarrStore(store.url), (index, after)))
    assert outcomes == {False, True}  # some crashes kept the old version, later ones the new


def old_or_new_whole(reader, where) -> bool:
    """Check that scan_1 (first 0.5) is whole after a crash — one value, every row — and that
    collecting garbage leaves its committed version alone; returns whether it is the new one."""
    value = np.unique(reader.read_array("ct/windows", "scan_1", "lung"))
    coords = reader.read_array("ct/windows", "scan_1", "coords")
    assert len(value) == 1 and value[0] in (0.5, 0.25, 0.75), (where, value)
    np.testing.assert_array_equal(coords.ravel(), np.arange(300))
    collect(reader, older_than_s=0)
    record = reader.commit_record("ct/windows", "scan_1")
    assert versions(reader, "scan_1") == [record["version"]], where
    return float(value[0]) != 0.5


@pytest.mark.parametrize(
    "key",
    ["../x", "/etc/passwd", "a/b", "..", ".", "", ".hidden", "_x", "x" * 201, "scan 1", "ok\0"],
)
def test_hostile_keys_are_refused(store, key):
    with pytest.raises(InvalidKeyError):
        store.path("ct/windows", key)
    with pytest.raises(InvalidKeyError):
        store.write_partition("ct/windows", key).__enter__()


@pytest.mark.parametrize("asset", ["../ct", "/abs", "ct//w", "ct/../../x", "ct/"])
def test_hostile_assets_are_refused(store, asset):
    with pytest.raises(InvalidKeyError):
        store.list_partitions(asset)


def test_sanitise_key():
    assert sanitise_key("train_1_a_1.nii.gz") == "train_1_a_1.nii.gz"
    assert sanitise_key("../../etc/passwd") == "etc_passwd"
    assert sanitise_key("scan 01/üml") == "scan_01_ml"
    with pytest.raises(InvalidKeyError):
        sanitise_key("../")


def test_chunk_policy():
    assert chunks_for((240, 480, 480), "float16", "patch") == ((64, 64, 64), None)
    assert chunks_for((5, 396, 640), "uint8", "frame") == ((1, 396, 640), None)
    chunks, shards = chunks_for((300, 96, 160), "uint8", "frame")  # 15 KiB frames → sharded
    assert chunks == (1, 96, 160) and shards is not None and shards[0] > 1
    assert chunks_for((1_000_000, 3), "uint16", "rows") == ((65536, 3), None)


def test_commit_record_is_json_with_stored_bytes(store):
    write(store, "scan_1", 0.5)
    record = store.commit_record("ct/windows", "scan_1")
    json.dumps(record)
    assert record["arrays"]["lung"]["codec"]["configuration"]["cname"] == "lz4"
    assert record["stored_bytes"] > 0


def test_an_array_opens_from_its_commit_record_and_a_disagreeing_one_is_refused(store, monkeypatch):
    write(store, "scan_1", 0.5)
    record = store.commit_record("ct/windows", "scan_1")
    on_disk = store.open_array("ct/windows", "scan_1", "lung")
    recorded = arrays.recorded_array(store, record, "ct/windows", "scan_1", "lung")
    assert recorded is not None and recorded.metadata == on_disk.metadata
    # The read takes the array's metadata from the record: its zarr.json is never read.
    monkeypatch.setattr(store, "open_array", lambda *a, **k: pytest.fail("zarr.json read"))
    assert (store.read_array("ct/windows", "scan_1", "lung") == 0.5).all()
    # A record whose copy of zarr.json disagrees with its own shape fails loudly.
    record["arrays"]["lung"]["zarr_json"]["shape"] = [20, 30, 41]
    monkeypatch.setattr(store, "commit_record", lambda asset, key: record)
    with pytest.raises(StoreError, match=r"lung: the commit record's zarr\.json .* disagrees"):
        store.read_array("ct/windows", "scan_1", "lung")
    # A record of an older zarrfeed (no copy) reads the array's own zarr.json.
    del record["arrays"]["lung"]["zarr_json"]
    monkeypatch.undo()
    monkeypatch.setattr(store, "commit_record", lambda asset, key: record)
    assert (store.read_array("ct/windows", "scan_1", "lung") == 0.5).all()


@pytest.mark.parametrize(
    ("shape", "dtype", "chunks", "shards"),
    [
        ((70, 130, 65), "float16", (64, 64, 64), None),  # partial edge chunks on every axis
        ((5, 40, 48), "uint8", (1, 40, 48), None),  # whole frames: decoded in place
        ((300, 3), "uint16", (128, 3), None),  # row blocks with a short last one
        ((64, 64, 64), "int16", (16, 16, 16), (32, 64, 64)),  # sharded: zarr's own reader
    ],
)
def test_chunk_io_equals_zarr(tmp_path, shape, dtype, chunks, shards):
    rng = np.random.default_rng(0)
    data = (rng.random(shape) * 100).astype(dtype)
    data[: chunks[0]] = 0  # all-fill chunks: zarr does not write them

    def create(name: str) -> zarr.Array:
        return zarr.create_array(
            tmp_path / name, shape=shape, dtype=dtype, chunks=chunks, shards=shards,
            compressors=compressors_for(dtype), fill_value=0,
        )  # fmt: skip

    backend = LocalBackend(tmp_path)
    create("zarr.zarr")[...] = data
    ours = str(tmp_path / "ours.zarr")
    write_from(create("ours.zarr"), data, lambda coded: backend.put_many(ours, coded), threads=3)
    files = {}
    for name in ("zarr.zarr", "ours.zarr"):
        files[name] = sorted(p.relative_to(tmp_path / name) for p in (tmp_path / name).rglob("*"))
        np.testing.assert_array_equal(zarr.open_array(tmp_path / name, mode="r")[...], data)
    assert files["ours.zarr"] == files["zarr.zarr"]  # same chunks written, same fills skipped
    arr = zarr.open_array(tmp_path / "zarr.zarr", mode="r")
    folder = str(tmp_path / "zarr.zarr")
    chunked = ChunkedArray(arr, backend, folder, f"{folder}/zarr.json")
    assert (BloscLayout.of(arr) is None) == (shards is not None)  # which reader ran
    for threads in (1, 3):
        np.testing.assert_array_equal(chunked.read(threads=threads), data)
    region = tuple(slice(n // 3, n - 1) for n in shape)
    np.testing.assert_array_equal(chunked.read(region), data[region])
    with pytest.raises(ValueError, match="C-contiguous"):
        chunked.read_into(np.empty(shape, dtype).T)
    with pytest.raises(ValueError, match="write_from: expected"):
        write_from(arr, data.astype("float64"), None)


def test_read_into_names_a_corrupt_chunk(tmp_path):
    arr = zarr.create_array(tmp_path / "a.zarr", shape=(8, 8), dtype="int16", chunks=(4, 8),
                            compressors=compressors_for("int16"))  # fmt: skip
    arr[...] = np.arange(64, dtype="int16").reshape(8, 8)
    (tmp_path / "a.zarr" / "c" / "1" / "0").write_bytes(b"not blosc at all, truncated")
    folder = str(tmp_path / "a.zarr")
    chunked = ChunkedArray(
        zarr.open_array(folder, mode="r"), LocalBackend(tmp_path), folder, f"{folder}/zarr.json"
    )
    with pytest.raises(StoreError, match=r"a\.zarr/c/1/0: chunk does not decode"):
        chunked.read()


def test_consolidation_reads_only_what_changed_and_equals_a_fresh_one(store, monkeypatch):
    def rows(key: str, start: int) -> None:
        with store.write_partition("ct/patches", key, {}) as w:
            w.write("origins", np.arange(start, start + 12, dtype=np.uint16).reshape(4, 3))

    for i, key in enumerate(["a", "b", "c"]):
        rows(key, 100 * i)
    reads: list[str] = []
    real = store.read_array

    def counted(asset, key, name, version=None):
        reads.append(f"{asset}/{key}")
        return real(asset, key, name, version)

    monkeypatch.setattr(store, "read_array", counted)

    def tables():
        return consolidate(store, "ct", "ct/patches", ["a", "b", "c"], ["origins"], table="patches")

    assert tables()["rows"] == 12
    assert sorted(reads) == ["ct/patches/a", "ct/patches/b", "ct/patches/c"]
    reads.clear()
    assert tables()["rows"] == 12
    assert reads == []  # nothing changed: nothing read, nothing written
    rows("b", 900)  # a rebuilt partition
    reads.clear()
    tables()
    assert [r for r in reads if r.startswith("ct/")] == ["ct/patches/b"]
    table = real("datasets/ct", "patches", "origins")
    fresh = np.concatenate([real("ct/patches", k, "origins") for k in ["a", "b", "c"]])
    np.testing.assert_array_equal(table, fresh)
    np.testing.assert_array_equal(real("datasets/ct", "patches", "offsets"), [0, 4, 8, 12])


@pytest.mark.parametrize("fill", [0, -1024])
def test_a_large_read_gives_the_fill_value_where_no_chunk_was_written(tmp_path, fill):
    # Beyond ZEROED_BYTES a read with a zero fill decodes into zeroed memory and leaves the
    # chunks never written as they are; any other fill is written there.
    store = ZarrStore(tmp_path / "s.zarr")
    data = np.full((80, 512, 512), fill, np.int16)
    assert data.nbytes >= ZEROED_BYTES
    data[:16] = 7
    data[40:50, 100:300, 7:9] = -3
    with store.write_partition("ct/hu", "k") as w:
        w.write("hu", data, chunks=(16, 128, 128), fill_value=fill)
    array = store.chunked("ct/hu", "k", "hu")
    written = sum(len(files) for _, _, files in os.walk(f"{array.folder}/c"))
    assert written == 16 + 6  # of 80 chunks: most were never written
    np.testing.assert_array_equal(array.read(), data)
    region = (slice(3, 77), slice(1, 500), slice(5, 511))
    np.testing.assert_array_equal(array.read(region), data[region])


@pytest.mark.parametrize("attr", ["array_xxh3_128", "array_sha256"])
def test_verify_checks_each_partition_with_the_hash_it_recorded(tmp_path, attr):
    """Partitions built before the switch to XXH3 carry SHA-256 sums: verify must recompute
    the hash each partition recorded (another hash would call every old partition changed)
    and still catch one flipped bit."""
    from zarrfeed.commands.verify import verify_partition
    from zarrfeed.families.ct import CT, CT_WINDOWS
    from zarrfeed.store.checksums import HASHES

    store = ZarrStore(tmp_path / "s.zarr")
    window = np.random.default_rng(0).random((20, 30, 40)).astype(np.float16)

    def build(data: np.ndarray) -> None:
        attrs = provenance("raw.nii.gz", None, "1", {"windows": ["lung"]})
        attrs[attr] = {"lung": HASHES[attr](window)}  # recorded at build
        with store.write_partition(CT_WINDOWS.path, "k", attrs) as w:
            w.write("lung", data)

    build(window)
    ok = verify_partition(store, CT, CT_WINDOWS, "k", catalog={})
    assert ok.status == "ok", ok.details
    flipped = window.copy()
    flipped.view(np.uint16)[3, 4, 5] ^= 1
    build(flipped)
    bad = verify_partition(store, CT, CT_WINDOWS, "k", catalog={})
    assert bad.status == "MISMATCH"
    assert bad.details == ["lung: content checksum differs from the one recorded at build"]
