import json
import os
import subprocess
import sys

import numpy as np
import pytest
import zarr

from zarrfeed.errors import InvalidKeyError, StoreError
from zarrfeed.store import ZarrStore, chunks_for, compressors_for, provenance, sanitise_key
from zarrfeed.store.chunkio import _direct_layout, read_array, read_into, write_from


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
    manifest = store.write_manifest("ct/windows", split="train")
    assert manifest == store.read_manifest("ct/windows")
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
    assert not store.fs.exists(f"{store.root}/.zarrfeed/staging") or not store.fs.ls(
        f"{store.root}/.zarrfeed/staging"
    )


def test_force_rewrite_replaces_arrays_and_attrs(store):
    write(store, "scan_1", 0.5, source="old")
    with store.write_partition("ct/windows", "scan_1", {"source": "new"}) as w:
        w.write("lung", np.ones((5, 5, 5), dtype=np.float16))
    group = store.open_partition("ct/windows", "scan_1")
    assert group.attrs["source"] == "new" and sorted(group.array_keys()) == ["lung"]
    assert store.commit_record("ct/windows", "scan_1")["arrays"]["lung"]["shape"] == [5, 5, 5]


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
    staging = tmp_path / "s.zarr" / ".zarrfeed" / "staging"
    assert len(os.listdir(staging)) == 1  # the debris stays out of sight …
    assert store.clean_staging(older_than_s=0) == 1  # … until cleaned
    assert os.listdir(staging) == []


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

    create("zarr.zarr")[...] = data
    write_from(create("ours.zarr"), data, threads=3)
    files = {}
    for name in ("zarr.zarr", "ours.zarr"):
        files[name] = sorted(p.relative_to(tmp_path / name) for p in (tmp_path / name).rglob("*"))
        np.testing.assert_array_equal(zarr.open_array(tmp_path / name, mode="r")[...], data)
    assert files["ours.zarr"] == files["zarr.zarr"]  # same chunks written, same fills skipped
    arr = zarr.open_array(tmp_path / "zarr.zarr", mode="r")
    assert (_direct_layout(arr) is None) == (shards is not None)  # which reader ran
    for threads in (1, 3):
        np.testing.assert_array_equal(read_array(arr, threads=threads), data)
    with pytest.raises(ValueError, match="C-contiguous"):
        read_into(arr, np.empty(shape, dtype).T)
    with pytest.raises(ValueError, match="write_from: expected"):
        write_from(arr, data.astype("float64"))


def test_read_into_names_a_corrupt_chunk(tmp_path):
    arr = zarr.create_array(tmp_path / "a.zarr", shape=(8, 8), dtype="int16", chunks=(4, 8),
                            compressors=compressors_for("int16"))  # fmt: skip
    arr[...] = np.arange(64, dtype="int16").reshape(8, 8)
    (tmp_path / "a.zarr" / "c" / "1" / "0").write_bytes(b"not blosc at all, truncated")
    with pytest.raises(StoreError, match=r"a\.zarr/c/1/0: chunk does not decode"):
        read_array(zarr.open_array(tmp_path / "a.zarr", mode="r"))
