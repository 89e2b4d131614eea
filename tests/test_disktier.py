"""The local-disk tier between an object store and RAM: within its byte budget, never serving
a torn chunk or another version's, and a second epoch that reads nothing from the bucket
(a real SeaweedFS server, one per module)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest
import s3server

from zarrfeed.datasets import build_manifest
from zarrfeed.store import ZarrStore
from zarrfeed.store import disktier as tiers
from zarrfeed.store.disktier import DiskTier
from zarrfeed.training.data.outofcore import OutOfCoreArrays
from zarrfeed.training.data.regimes import cached_arrays

BUCKET = "zarrfeed-tier"
ASSET = "ct/windows"


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    with s3server.seaweedfs(tmp_path_factory.mktemp("weed")) as server:
        server.make_bucket(BUCKET)
        yield server


@pytest.fixture
def tier_env(tmp_path, monkeypatch):
    """The environment's tier: this account's folder under ``ZARRFEED_DISK_CACHE``."""
    monkeypatch.setenv("ZARRFEED_DISK_CACHE", str(tmp_path / "tier"))
    monkeypatch.setenv("ZARRFEED_DISK_CACHE_GB", "1")
    return tiers.tier_folder()


def s3_store(weed) -> ZarrStore:
    return ZarrStore(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", weed.storage_options())


def commit(store, key, value, shape=(32, 32, 32)):
    with store.write_partition(ASSET, key, {"source": f"{key}.nii.gz"}) as w:
        rng = np.random.default_rng(int(value * 1000))  # incompressible enough to be real
        data = (rng.random(shape) + value).astype(np.float32)
        w.write("lung", data, chunks=(16, 16, 16))
    return data


def counting_gets(store, monkeypatch) -> list[str]:
    """Every object the store's S3 client GETs from now on (chunks and metadata)."""
    fs = store.backend.fs
    got: list[str] = []
    real = fs._cat_file

    async def cat_file(path, *args, **kwargs):
        got.append(path)
        return await real(path, *args, **kwargs)

    monkeypatch.setattr(fs, "_cat_file", cat_file)
    return got


def test_the_tier_stays_within_its_byte_budget_and_evicts_the_least_recently_used(tmp_path):
    entry = tiers.HEADER.size + 10_000
    tier = DiskTier(tmp_path / "tier", budget_bytes=10 * entry)
    for i in range(10):
        tier.put(f"{i:032x}", bytes([i]) * 10_000)
    assert tier.held_bytes() == 10 * entry
    time.sleep(0.01)
    assert tier.get(f"{0:032x}") == bytes([0]) * 10_000  # used: now the most recent
    for i in range(10, 30):
        tier.put(f"{i:032x}", bytes([i]) * 10_000)
        assert tier.held_bytes() <= tier.budget_bytes
    assert tier.get(f"{1:032x}") is None  # the least recently used went first
    assert tier.get(f"{29:032x}") == bytes([29]) * 10_000
    # A second process counts into the same budget.
    other = DiskTier(tmp_path / "tier", budget_bytes=10 * entry)
    for i in range(30, 40):
        other.put(f"{i:032x}", b"x" * 10_000)
        tier.put(f"{i + 100:032x}", b"y" * 10_000)
    assert tier.held_bytes() <= tier.budget_bytes


def test_a_writer_killed_mid_batch_leaves_the_count_high_never_low(tmp_path):
    """Bytes are counted before they are written: entries a killed process wrote are never
    missing from the count, which would let the tier outgrow its budget unseen."""
    folder = tmp_path / "tier"
    entry = tiers.HEADER.size + 1000
    tier = DiskTier(folder, budget_bytes=10_000 * entry)  # one count per 100 entries
    written = 0

    def write_then_die(key: str, payload: bytes) -> object:
        nonlocal written
        if written == 150:
            os._exit(9)  # killed: no finally, no exit handler
        written += 1
        return DiskTier._write(tier, key, payload)

    pid = os.fork()
    if pid == 0:
        tier._write = write_then_die
        tier.put_batch([(f"{i:032x}", b"k" * 1000) for i in range(300)])
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    held = tier.held_bytes()
    assert held == 150 * entry  # the entries written before the kill are whole
    assert int((folder / tiers._USAGE).read_text()) >= held


def test_a_hit_refreshes_an_entry_so_eviction_takes_the_others(tmp_path):
    entry = tiers.HEADER.size + 1000
    tier = DiskTier(tmp_path / "tier", budget_bytes=4 * entry)
    for i in range(4):
        tier.put(f"{i:032x}", b"a" * 1000)
        time.sleep(0.01)
    assert tier.get(f"{0:032x}") is not None
    tier.put(f"{9:032x}", b"b" * 1000)  # over budget: down to 90 %, the oldest go
    assert tier.get(f"{0:032x}") is not None and tier.get(f"{1:032x}") is None


def test_clear_leaves_no_entry_still_on_its_way_to_the_disk(tmp_path, monkeypatch):
    tier, key = DiskTier(tmp_path / "tier", 10**9), "cd" * 16
    gate, write = threading.Event(), tier.put_batch
    monkeypatch.setattr(tier, "put_batch", lambda items: gate.wait(10) and write(items))
    tier.put_many([(key, b"p" * 1000)])
    assert tier.get(key) == b"p" * 1000  # served from memory until its file is in place
    clearing = threading.Thread(target=tier.clear)
    clearing.start()
    clearing.join(0.2)
    assert clearing.is_alive()  # waits for the write on its way
    gate.set()
    clearing.join(10)
    tier.flush()
    assert tier.get(key) is None and tier.held_bytes() == 0


KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from zarrfeed.store.disktier import DiskTier
    def stall(*args):  # the data is in the temporary file; the writer dies before the rename
        print("writing", flush=True)
        time.sleep(60)
    os.replace = stall
    DiskTier(sys.argv[1], 10**9).put(sys.argv[2], b"z" * 5_000_000)
    """
)


def test_a_killed_fetch_never_leaves_a_torn_chunk_that_is_served(tmp_path, monkeypatch):
    folder, key = tmp_path / "tier", "ab" * 16
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(folder), key], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    tier = DiskTier(folder, 10**9)
    leftovers = list((folder / key[:2]).iterdir())
    assert [p.name.endswith(".tmp") for p in leftovers] == [True]
    assert tier.get(key) is None  # never at its name: a miss, fetched again
    monkeypatch.setattr(tiers, "STALE_TMP_S", 0.0)
    assert tier.held_bytes() == 0 and list((folder / key[:2]).iterdir()) == []
    # A file torn where it stands (a disk that lost its tail) is discarded, not served.
    tier.put(key, b"q" * 1000)
    path = folder / key[:2] / key
    with open(path, "r+b") as f:
        f.truncate(500)
    assert tier.get(key) is None and not path.exists()
    tier.put(key, b"q" * 1000)
    with open(path, "r+b") as f:  # same length, one byte flipped
        f.seek(700)
        f.write(b"r")
    assert tier.get(key) is None and tier.discarded == 2


def test_a_corrupt_tier_entry_is_fetched_again_from_the_bucket(weed, tier_env):
    store = s3_store(weed)
    data = commit(store, "scan_1", 0.5)
    np.testing.assert_array_equal(store.read_array(ASSET, "scan_1", "lung"), data)
    store.tier.flush()  # written in the background
    entries = [p for p in tier_env.rglob("*") if p.is_file() and len(p.name) == 32]
    assert len(entries) == 8  # one per chunk
    for p in entries:
        p.write_bytes(p.read_bytes()[:-10])
    np.testing.assert_array_equal(store.read_array(ASSET, "scan_1", "lung"), data)
    assert store.tier.discarded == 8


def test_a_rebuilt_partition_is_never_served_from_the_tier(weed, tier_env):
    store = s3_store(weed)
    commit(store, "scan_1", 0.5)
    store.read_array(ASSET, "scan_1", "lung")  # now in the tier
    rebuilt = commit(store, "scan_1", 2.5)
    np.testing.assert_array_equal(store.read_array(ASSET, "scan_1", "lung"), rebuilt)
    # The same paths under another server's identity are other entries.
    assert DiskTier.key(store.identity, "a/b") != DiskTier.key(store.identity + "x", "a/b")


def test_a_second_epoch_reads_nothing_from_the_bucket(weed, tier_env, monkeypatch):
    store = s3_store(weed)
    data = {f"scan_{i}": commit(store, f"scan_{i}", i) for i in range(4)}
    partitions = build_manifest(store, ASSET)["partitions"]
    # Out of core: an arena of 16 chunks for 32 stored ones, so every epoch decodes again.
    cache = cached_arrays(store, {ASSET: (partitions, ["lung"])}, budget_bytes=16 * 16**3 * 4)
    assert isinstance(cache, OutOfCoreArrays) and not cache.in_ram
    try:
        for item, key in enumerate(data):  # epoch 1: the chunks come from the bucket
            np.testing.assert_array_equal(cache.array(ASSET, item, "lung"), data[key])
        cache.store.tier.flush()  # written in the background
        held = cache.store.tier.held_bytes()
        got = counting_gets(cache.store, monkeypatch)
        cache.clear()  # nothing decoded in RAM: epoch 2 decodes every chunk again
        for item, key in enumerate(data):
            np.testing.assert_array_equal(cache.array(ASSET, item, "lung"), data[key])
        assert got == [] and cache.store.tier.hits >= 32
        assert cache.store.tier.held_bytes() == held
    finally:
        cache.close()


def test_a_read_ahead_fetches_only_what_the_tier_lacks_and_the_decode_then_gets_nothing(
    weed, tier_env, monkeypatch
):
    store = s3_store(weed)
    data = commit(store, "ahead", 0.5)
    array = store.chunked(ASSET, "ahead", "lung")
    got = counting_gets(store, monkeypatch)
    assert array.warm([(0, 0, 0), (0, 0, 1)]) == 2
    assert array.warm([(0, 0, 0), (0, 0, 1), (1, 1, 1)]) == 1  # two held already
    assert len(got) == 3
    np.testing.assert_array_equal(array.read((slice(0, 16), slice(0, 16), slice(0, 32))),
                                  data[:16, :16, :32])  # fmt: skip
    assert len(got) == 3  # every chunk it needed came from the tier


def test_reading_a_block_ahead_fills_the_tier_not_the_arena(weed, tier_env, monkeypatch):
    store = s3_store(weed)
    data = {f"scan_{i}": commit(store, f"scan_{i}", i) for i in range(4)}
    partitions = build_manifest(store, ASSET)["partitions"]
    cache = cached_arrays(store, {ASSET: (partitions, ["lung"])}, budget_bytes=16 * 16**3 * 4)
    assert isinstance(cache, OutOfCoreArrays)  # out of core: units are the stored chunks
    try:
        ahead = cache.units.whole_units(ASSET, ["lung"], np.array([1]))  # scan_1's 8 units
        got = counting_gets(cache.store, monkeypatch)
        cache.read_ahead(ahead)
        assert len(got) == 8 and not cache.resident(ahead).any()  # fetched, not decoded
        cache.read_ahead(ahead)
        assert len(got) == 8  # held already: nothing fetched again
        np.testing.assert_array_equal(cache.array(ASSET, 1, "lung"), data["scan_1"])
        assert len(got) == 8  # decoded from the tier
    finally:
        cache.close()


def test_the_cache_command_lists_and_clears_the_tier(tier_env, capsys):
    from zarrfeed.cli import main

    tier = DiskTier(tier_env, 10**9)
    tier.put("cd" * 16, b"c" * 2_000_000)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "disk tier 0.002 GB of 1.000 GB in 1 chunks" in out and str(tier_env) in out
    assert main(["cache", "clear", "disk"]) == 0
    assert "removed 1 cache(s)" in capsys.readouterr().out
    assert tier.get("cd" * 16) is None and tier.held_bytes() == 0


def _put_one(folder: str) -> None:
    DiskTier(folder, 10**9).put("ef" * 16, b"e" * 1000)


def test_a_worker_forked_while_the_lock_is_held_does_not_wait_forever(tmp_path):
    import multiprocessing
    import threading

    tier = DiskTier(tmp_path / "tier", 10**9)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with tier._locked():
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    child = multiprocessing.get_context("fork").Process(target=_put_one, args=(str(tier.folder),))
    child.start()  # forked while this process holds the lock
    release.set()
    holder.join()
    child.join(timeout=20)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
    assert tier.get("ef" * 16) == b"e" * 1000


def out_of_core(weed) -> tuple[OutOfCoreArrays, np.ndarray, dict[str, np.ndarray]]:
    """A RAM cache over 4 scans committed in the bucket, beyond its budget (out of core); the
    units of scan 1 (what a block sampler reads ahead); each scan's data."""
    store = s3_store(weed)
    data = {f"scan_{i}": commit(store, f"scan_{i}", i) for i in range(4)}
    partitions = build_manifest(store, ASSET)["partitions"]
    cache = cached_arrays(store, {ASSET: (partitions, ["lung"])}, budget_bytes=16 * 16**3 * 4)
    return cache, cache.units.whole_units(ASSET, ["lung"], np.array([1])), data


def test_a_read_ahead_of_what_a_warm_tier_holds_fetches_nothing_and_looks_at_no_chunk_file(
    weed, tier_env, monkeypatch
):
    cache, ahead, _ = out_of_core(weed)
    try:
        got = counting_gets(cache.store, monkeypatch)
        cache.read_ahead(ahead)
        cache.store.tier.flush()
        assert len(got) == 8
        looked: list[str] = []
        stat = os.stat

        def counting_stat(path, *args, **kwargs):
            if str(path).startswith(str(tier_env)):
                looked.append(str(path))
            return stat(path, *args, **kwargs)

        monkeypatch.setattr(os, "stat", counting_stat)
        cache.read_ahead(ahead)
        assert len(got) == 8 and looked == []  # remembered: no GET, no stat of an entry
    finally:
        cache.close()


def test_a_remembered_entry_evicted_elsewhere_is_fetched_again_never_served_wrong(
    weed, tier_env, monkeypatch
):
    cache, ahead, data = out_of_core(weed)
    try:
        got = counting_gets(cache.store, monkeypatch)
        cache.read_ahead(ahead)
        tier = cache.store.tier
        tier.flush()
        # Another process's tier over the same folder evicts every entry for its own.
        other = DiskTier(tier_env, 25_000)
        time.sleep(0.01)  # the newest entry: the others are evicted for it
        other.put("ef" * 16, b"o" * 20_000)
        assert [p for p in tier_env.rglob("*") if len(p.name) == 32] == [
            tier_env / "ef" / ("ef" * 16)
        ]
        cache.read_ahead(ahead)  # the eviction count tells: all 8 fetched again
        tier.flush()
        assert len(got) == 16
        # An entry gone without an eviction (removed by hand) is still remembered by the
        # read-ahead, and the decode then reads it as a miss and fetches it: never wrong.
        entry = next(p for p in tier_env.rglob("*") if len(p.name) == 32 and p.name[:2] != "ef")
        entry.unlink()
        cache.read_ahead(ahead)
        assert len(got) == 16
        np.testing.assert_array_equal(cache.array(ASSET, 1, "lung"), data["scan_1"])
        assert len(got) == 17
    finally:
        cache.close()
