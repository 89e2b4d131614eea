"""The shared training cache out of core and in RAM: identity, budget, crash safety, no torn
reads, the block sampler, and machine-wide hygiene — on small CT stores made here whose voxel
values say where they come from."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from zarrfeed import locks
from zarrfeed.datasets import Retention, collect, consolidate, write_dataset
from zarrfeed.errors import ConfigError, StoreError
from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.store import ZarrStore, commits, provenance
from zarrfeed.training import BlockSampler, make_loader, make_sampler
from zarrfeed.training.data import arena as arena_module
from zarrfeed.training.data.ring import settle
from zarrfeed.training.data.sampler import ResumableSampler, follow_order, sample_order
from zarrfeed.training.data.shm import clear_caches, held_bytes, list_caches, sweep

PATCH = 32


def values(
    shape: tuple[int, ...], key: int, offset: int = 0, origin: tuple[int, ...] = (0, 0, 0)
) -> np.ndarray:
    """Blocky float16 volume whose every voxel says its volume and position (exact in f16);
    with ``origin``, the box of ``shape`` at that corner of a larger such volume."""
    z, y, x = np.ogrid[tuple(slice(o, o + n) for o, n in zip(origin, shape, strict=True))]
    return ((z // 8 * 31 + y // 8 * 7 + x // 8 * 3 + key * 13 + offset) % 97).astype(np.float16)


def build_ct(
    root: Path, n: int = 8, shape=(64, 128, 128), per: int = 16, offset: int = 0
) -> ZarrStore:
    """A store as the CT assets leave it: windows in 64³ chunks, patch index, manifests."""
    store = ZarrStore(root)
    rng = np.random.default_rng(1)
    keys = [f"vol_{i}" for i in range(n)]
    for i, key in enumerate(keys):
        with store.write_partition("ct/windows", key, provenance("test", None, "1")) as w:
            w.write("lung", values(shape, i, offset))
        origins = np.stack([rng.integers(0, s - PATCH + 1, per) for s in shape], 1)
        attrs = provenance("test", None, "1", patch_shape=[PATCH] * 3)
        with store.write_partition("ct/patches", key, attrs) as w:
            w.write("origins", origins.astype(np.uint16), read="rows")
    listed = write_dataset(store, "ct", ["ct/windows", "ct/patches"])["keys"]  # sorted
    consolidate(store, "ct", "ct/patches", listed, ["origins"], table="patches")
    return store


def expected(ds: CTPatchDataset, index: int, offset: int = 0) -> np.ndarray:
    """Sample ``index``'s patch as the stored volume holds it, computed for the patch alone
    (the whole volume for every patch cost 20 s a test on 128x256x256)."""
    item = int(ds.items[index])
    shape = ds.partitions[item]["arrays"]["lung"]["shape"]
    origin = tuple(int(o) for o in ds.origins[index])
    box = tuple(max(0, min(PATCH, n - o)) for n, o in zip(shape, origin, strict=True))
    return values(box, item, offset, origin)  # clipped at the volume's edge, as slicing is


def unit_budget_gb(units: int) -> float:
    """A budget whose arena holds ``units`` slots of 64³ float16."""
    return (units * ((512 << 10) + 48) + (64 << 10)) / (1 << 30)


@pytest.fixture(scope="module")
def ct_store(tmp_path_factory) -> ZarrStore:
    return build_ct(tmp_path_factory.mktemp("ct") / "store.zarr")


def test_beyond_ram_reads_equal_the_store_and_decode_only_what_patches_touch(ct_store):
    ds = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(20))
    assert not ds.cache.in_ram and ds.cache.arena.slots == 20
    ds.cache.clear()
    for i in (0, 7, 50, len(ds) - 1):
        np.testing.assert_array_equal(ds[i]["image"][0].numpy(), expected(ds, i))
    batch = ds.collate(ds.__getitems__(list(range(0, 40, 5))))
    for row, i in enumerate(range(0, 40, 5)):
        np.testing.assert_array_equal(batch["image"][row, 0].numpy(), expected(ds, i))
    stats = ds.cache.stats()
    touched = ds.sample_units(np.array([0, 7, 50, len(ds) - 1, *range(0, 40, 5)]))
    assert stats["misses"] <= len(touched) and stats["bytes_decoded"] <= len(touched) * (512 << 10)
    whole = ds.array(3, "lung")  # a whole array out of core: assembled from its units
    np.testing.assert_array_equal(whole, values(whole.shape, 3))


def test_an_array_larger_than_the_whole_budget_is_read_by_units(tmp_path):
    """One volume of 32 units through a 16-slot arena: patches and the whole array are
    exact, and the arena never grows past its budget."""
    store = build_ct(tmp_path / "store.zarr", n=1, shape=(128, 256, 256), per=64)
    budget = unit_budget_gb(16)
    ds = CTPatchDataset(store, cache_gb=budget)
    arena = ds.cache.arena
    assert not ds.cache.in_ram and arena.slots == 16 and ds.nbytes() == 2 * arena.capacity_bytes
    for epoch in range(2):  # the second pass reads through slots the first one filled
        for i in np.random.default_rng(epoch).permutation(len(ds)):
            np.testing.assert_array_equal(ds[int(i)]["image"][0].numpy(), expected(ds, int(i)))
    whole = ds.array(0, "lung")
    np.testing.assert_array_equal(whole, values((128, 256, 256), 0))
    assert arena.file_bytes <= budget * (1 << 30) and ds.cache.stats()["evictions"] > 0


def test_rebuilt_partition_is_read_anew_while_an_open_reader_keeps_its_version(tmp_path):
    """A rebuild never disturbs a dataset opened before it: it reads its own version until
    closed; new datasets read the rebuilt bytes; once the old version is collected, opening
    it by id fails loudly naming it instead of serving other bytes."""
    store = build_ct(tmp_path / "store.zarr", n=3, shape=(64, 64, 64))
    for gb in (1.0, unit_budget_gb(16)):  # in RAM, then out of core (16 slots, 3 units)
        ds = CTPatchDataset(store, cache_gb=gb)
        ds.preload()
        np.testing.assert_array_equal(ds[0]["image"][0].numpy(), expected(ds, 0))
        ds.close()
    old = CTPatchDataset(store, cache_gb=unit_budget_gb(16))
    with store.write_partition("ct/windows", "vol_0", provenance("test", None, "2")) as w:
        w.write("lung", values((64, 64, 64), 0, offset=50))
    write_dataset(store, "ct", ["ct/windows", "ct/patches"], retention=Retention(last=1, days=0))
    for gb in (1.0, unit_budget_gb(16)):
        ds = CTPatchDataset(store, cache_gb=gb)
        ds.preload()
        np.testing.assert_array_equal(ds[0]["image"][0].numpy(), expected(ds, 0, offset=50))
        ds.close()
    collect(store, older_than_s=0)  # the old reader's lease keeps its version
    old.cache.clear()
    np.testing.assert_array_equal(old[0]["image"][0].numpy(), expected(old, 0))
    version = old.dataset_version
    old.close()
    collect(store, older_than_s=0)
    with pytest.raises(StoreError, match=rf"{version}.*(collected|gone|removed)"):
        CTPatchDataset(store, cache_gb=unit_budget_gb(16), dataset_version=version)


def test_two_stores_with_one_relative_name_never_share_entries(tmp_path, monkeypatch):
    fixed = commits.new_version()  # the same versions too: only the location differs
    monkeypatch.setattr(commits, "new_version", lambda now=None: fixed)
    for offset, folder in ((0, "a"), (40, "b")):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        build_ct(Path("data/zarrfeed.zarr"), n=2, shape=(64, 64, 64), offset=offset)
    for gb in (1.0, unit_budget_gb(16)):
        for offset, folder in ((0, "a"), (40, "b"), (0, "a")):
            monkeypatch.chdir(tmp_path / folder)
            ds = CTPatchDataset("data/zarrfeed.zarr", cache_gb=gb)
            ds.preload()
            np.testing.assert_array_equal(ds[3]["image"][0].numpy(), expected(ds, 3, offset))


def test_patch_size_is_the_listed_versions_not_a_later_rebuilds(tmp_path, monkeypatch):
    """The patch index of one scan is rebuilt at another patch size after the dataset was
    built: the dataset's table holds the old origins, so the patch size is the listed
    version's (formerly the new record's 48³ was cut at the 32³ origins, patches clipped to
    odd sizes at volume edges); once that version is gone, opening fails naming it."""
    store = build_ct(tmp_path / "store.zarr", n=2, shape=(64, 64, 64), per=4)
    attrs = provenance("test", None, "1", patch_shape=[48] * 3)
    with monkeypatch.context() as m:  # the replaced version stays (a failed clean-up)
        m.setattr(ZarrStore, "remove_version", lambda self, folder: None)
        with store.write_partition("ct/patches", "vol_0", attrs) as w:
            w.write("origins", np.zeros((2, 3), np.uint16), read="rows")
    ds = CTPatchDataset(store, cache_gb=0.1)
    assert ds.patch_shape == (PATCH,) * 3
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i]["image"][0].numpy(), expected(ds, i))
    listed = ds.manifest_assets["ct/patches"]["partitions"][0]["version"]
    store.remove_version(f"{store.path('ct/patches', 'vol_0')}/{listed}")  # cleaned up later
    with pytest.raises(StoreError, match="partition ct/patches/vol_0 is gone"):
        CTPatchDataset(store, cache_gb=0.1)


def _hammer(url: str, budget_gb: float, seed: int, seconds: float, ordered: bool) -> int:
    """Read random patches through a tiny shared arena and check every voxel (``ordered``
    off: copies under the slot's shared lock, as on CPUs that reorder loads)."""
    arena_module.ORDERED = ordered
    ds = CTPatchDataset(url, cache_gb=budget_gb)
    rng, reads, end = np.random.default_rng(seed), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        picks = rng.integers(0, len(ds), 4).tolist()
        batch = ds.collate(ds.__getitems__(picks))
        for row, i in enumerate(picks):
            if not np.array_equal(batch["image"][row, 0].numpy(), expected(ds, i)):
                raise AssertionError(f"wrong bytes for sample {i} in process {os.getpid()}")
        reads += len(picks)
    return reads


def test_concurrent_processes_never_read_torn_or_foreign_bytes(ct_store):
    budget = unit_budget_gb(16)  # 16 slots for 32 units: constant eviction
    CTPatchDataset(ct_store, cache_gb=budget).cache.clear()
    pool = mp.get_context("spawn").Pool(3)  # two seqlock readers, one locking reader
    try:
        args = [(ct_store.url, budget, s, 2.0, s < 2) for s in range(3)]
        reads = pool.starmap(_hammer, args)
    finally:  # close + join: workers end on their own, never relying on SIGTERM
        pool.close()
        pool.join()
    stats = CTPatchDataset(ct_store, cache_gb=budget).cache.stats()
    assert min(reads) > 0 and stats["evictions"] > 0 and stats["entries"] <= 16


def _die_mid_fill(url: str, budget_gb: float, marker: str, whole: bool) -> None:
    """Start filling the cache for sample 0, announce it, then hang until killed."""
    from zarrfeed.store import ChunkedArray

    def hang(*_args, **_kwargs):
        Path(marker).touch()
        time.sleep(600)

    monkey = "read_into" if whole else "read_chunks_into"
    setattr(ChunkedArray, monkey, hang)
    ds = CTPatchDataset(url, cache_gb=budget_gb)
    if whole:
        ds.preload()
    ds[0]


@pytest.mark.parametrize("whole", [False, True], ids=["arena", "in-RAM"])
def test_a_writer_killed_mid_fill_blocks_nobody(ct_store, tmp_path, whole):
    budget = 1.0 if whole else unit_budget_gb(16)
    ds = CTPatchDataset(ct_store, cache_gb=budget)
    ds.cache.clear()
    marker = tmp_path / "filling"
    child = mp.get_context("spawn").Process(
        target=_die_mid_fill, args=(ct_store.url, budget, str(marker), whole)
    )
    child.start()
    deadline = time.monotonic() + 60
    while not marker.exists() and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists(), "the writer never started filling"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    t0 = time.monotonic()
    np.testing.assert_array_equal(ds[0]["image"][0].numpy(), expected(ds, 0))
    assert time.monotonic() - t0 < 5
    if whole:  # the dead writer's half-written file is gone once its key is filled again
        assert not list(ds.cache.entries.folder.glob("*.tmp"))


def test_an_index_left_mid_update_by_a_dead_writer_is_rebuilt(ct_store):
    ds = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(16))
    ds.cache.clear()
    ds[0]
    arena = ds.cache.arena
    held = [s for s in range(arena.slots) if arena._key_hi[s]]
    arena._gen[held[0]] += 1  # as if a writer had died mid-fill, lock released
    for i in range(arena.buckets):
        arena._table[i] = 0  # and mid-update of the index
    arena._head[arena_module.H_DIRTY] = 1
    np.testing.assert_array_equal(ds[0]["image"][0].numpy(), expected(ds, 0))
    assert arena._head[arena_module.H_DIRTY] == 0 and arena._gen[held[0]] % 2 == 0


def _shmem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def _epoch_peaks(ds: CTPatchDataset, workers: int, ring: bool = False) -> tuple[int, int]:
    """(peak rise of Shmem, peak bytes the kernel holds for the cache's files) over one
    epoch, sampled every 2 ms from before the cache exists; with ``ring``, the workers write
    into batch slots that the consumer frees, as the training feed does."""
    peaks, stop = [0, 0], threading.Event()
    base = _shmem()

    def sample() -> None:
        while not stop.is_set():
            peaks[0] = max(peaks[0], _shmem() - base)
            peaks[1] = max(peaks[1], held_bytes(ds.cache.arena.folder.path))
            time.sleep(0.002)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        loader, plan = make_loader(ds, 4, workers=workers, context="fork", log=None, ring=ring)
        assert plan.ring == ring
        for batch in loader:
            assert settle(batch, pin=False)["image"].shape[0] > 0
        del loader
    finally:
        stop.set()
        thread.join()
    return peaks[0], peaks[1]


@pytest.mark.slow
@pytest.mark.parametrize("ring", [False, True], ids=["fresh batches", "batch slots"])
def test_shared_memory_stays_within_the_budget_under_two_workers(tmp_path, ring):
    # 16 volumes of 4 MiB (128 units of 64³ float16) for a 32-unit budget: 3.8x the cache.
    store = build_ct(tmp_path / "store.zarr", n=16, shape=(64, 128, 256), per=16)
    budget = unit_budget_gb(32)
    rises = []
    for _ in range(2):  # Shmem is machine-wide: a second try, should another process
        ds = CTPatchDataset(store, cache_gb=budget)  # allocate during the first
        assert not ds.cache.in_ram and ds.nbytes() > 3.5 * ds.budget_bytes
        clear_caches()
        rise, held = _epoch_peaks(ds, workers=2, ring=ring)
        assert held <= ds.budget_bytes  # the kernel's count of the cache's own files
        rises.append(rise)
        stats = ds.cache.stats()
        assert stats["bytes_decoded"] <= 2 * ds.nbytes(), stats
        if rise <= 1.1 * ds.budget_bytes:
            break
    assert min(rises) <= 1.1 * ds.budget_bytes, [r / ds.budget_bytes for r in rises]


# the block sampler ---------------------------------------------------------------------------


def test_block_sampler_is_deterministic_and_resumes_exactly(ct_store):
    ds = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(20))
    a, b = BlockSampler(ds, seed=3, prefetch=False), BlockSampler(ds, seed=3, prefetch=False)
    first = list(a)
    assert first == list(b) and sorted(first) == list(range(len(ds)))
    a.set_epoch(1)
    second = list(a)
    assert second != first and sorted(second) == sorted(first)
    a.set_epoch(1, start=37)
    assert len(a) == len(second) - 37 and list(a) == second[37:]
    assert list(b) == second  # a finished pass moves on to the next epoch by itself


def test_a_block_shuffle_takes_up_a_recorded_order_no_larger_than_its_own(ct_store):
    """A block shuffle's blocks follow the cache the machine could give it: a run resumed
    with other blocks would repeat some samples of the interrupted epoch and skip others.
    The recorded order is taken up when its blocks fit, and refused, said why, otherwise."""
    ds = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(20))
    here = BlockSampler(ds, seed=3, prefetch=False)
    smaller = BlockSampler(ds, seed=3, prefetch=False, block_bytes=here.block_bytes // 3)
    order = list(smaller)
    assert order != list(BlockSampler(ds, seed=3, prefetch=False))  # the blocks matter
    recorded = sample_order(smaller)
    assert follow_order(here, recorded) is None
    assert sample_order(here) == recorded
    here.set_epoch(0, start=11)
    assert list(here) == order[11:]
    larger = {"kind": "block", "block_bytes": here.block_bytes * 4}
    assert "sample order" in follow_order(here, larger)
    assert sample_order(here) == recorded  # unchanged by a refusal
    shuffle = ResumableSampler(len(ds), seed=3)
    assert "shuffle over the whole dataset" in follow_order(here, sample_order(shuffle))
    assert "block shuffle" in follow_order(shuffle, recorded)
    assert follow_order(shuffle, None) is None  # a checkpoint from before orders were kept


@pytest.mark.parametrize("world", [2, 3])
def test_block_sampler_shards_are_disjoint_and_cover_every_sample(ct_store, world):
    ds = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(20))
    shards = []
    for rank in range(world):
        sampler = BlockSampler(ds, rank, world, seed=5, prefetch=False)
        sampler.set_epoch(2)
        shards.append(list(sampler))
    assert len({len(s) for s in shards}) == 1  # DDP needs equal counts
    together = [i for s in shards for i in s]
    assert set(together) == set(range(len(ds)))
    padding = len(together) - len(ds)
    assert padding < world and len(set(together)) == len(ds)
    # each rank reads a contiguous run of partitions: few shared between ranks
    parts = [set(ds.items[s].tolist()) for s in shards]
    shared = sum(len(p & q) for i, p in enumerate(parts) for q in parts[i + 1 :])
    assert shared <= world  # only at the boundaries (and where padding wraps around)


def test_block_working_set_fits_and_the_next_block_is_prefetched(ct_store):
    ds = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(20))
    ds.cache.clear()
    sampler = BlockSampler(ds, seed=1)
    order, starts = sampler.plan()
    assert len(starts) > 1
    for lo, hi in zip(starts, [*starts[1:], len(order)], strict=True):
        units = ds.sample_units(order[lo:hi])
        assert len(units) * ds.cache.unit_bytes <= sampler.block_bytes
    it = iter(sampler)
    first = [next(it) for _ in range(starts[1])]  # the whole first block
    assert sorted(first) == sorted(order[: starts[1]].tolist())
    sampler._pool.submit(lambda: None).result()  # prefetches queued so far are done
    following = ds.sample_units(order[starts[1] : starts[2] if len(starts) > 2 else len(order)])
    assert ds.cache.resident(following).all()
    it.close()


def test_an_abandoned_pass_stops_its_prefetches_quietly(ct_store, monkeypatch, caplog):
    ds = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(20))
    started, release = threading.Event(), threading.Event()

    def failing(*args, **kwargs) -> None:  # a prefetch that fails after its pass ended
        started.set()
        release.wait(10)
        raise OSError("store closed")

    monkeypatch.setattr(ds.cache, "prefetch", failing)
    sampler = BlockSampler(ds, seed=1)
    it = iter(sampler)
    next(it)
    assert started.wait(10)
    pool = sampler._pool
    it.close()  # the loop broke out early
    assert sampler._pool is None
    release.set()
    pool.shutdown(wait=True)  # its thread ends: nothing keeps the process from exiting
    assert not [t for t in threading.enumerate() if t.name.startswith("zarrfeed-prefetch")]
    assert "prefetch of the next block failed" not in caplog.text
    # The same failure during a pass is reported.
    release.clear()
    it = iter(sampler)
    next(it)
    release.set()
    sampler._pool.submit(lambda: None).result()
    assert "prefetch of the next block failed: store closed" in caplog.text
    it.close()


@pytest.mark.parametrize("gb", [1.0, unit_budget_gb(16)], ids=["in-RAM", "out-of-core"])
def test_epochs_of_prefetch_threads_leave_no_descriptors_behind(ct_store, gb):
    """Each pass's prefetch thread opens the cache's lock file for its own locks; once that
    thread has ended, the next thread to open one closes it (formerly one descriptor per
    epoch stayed open for the life of the process)."""
    ds = CTPatchDataset(ct_store, cache_gb=gb)
    ds.cache.clear()  # in RAM: the prefetches decode, so they take the entries' locks
    sampler = BlockSampler(ds, seed=1, block_bytes=4 * ds.cache.unit_bytes)
    held = []
    for epoch in range(8):
        sampler.set_epoch(epoch)
        for i in sampler:
            ds[i]
        for thread in threading.enumerate():
            if thread.name.startswith("zarrfeed-prefetch"):
                thread.join()
        if ds.cache.in_ram:
            ds.cache.clear()  # every pass decodes again
        held.append(len(ds.cache.tier._fds))
    # this thread's open and the last pass's thread's (closed by the next thread's open)
    assert max(held) <= 2, held


@pytest.mark.parametrize("gb", [1.0, unit_budget_gb(16)], ids=["in-RAM", "out-of-core"])
def test_a_dropped_dataset_lets_go_of_its_cache(tmp_path, gb):
    """A dataset dropped without closing its cache (the trainer drops its own) closes the
    cache's descriptors and its hold on the cache folder, which a sweep may then remove;
    formerly each one left two descriptors open and the folder in use, its shared memory
    out of every sweep's reach, until the process ended."""
    store = build_ct(tmp_path / "store.zarr")

    def use_once() -> Path:
        ds = CTPatchDataset(store, cache_gb=gb)
        ds.__getitems__([0, 1, 2])
        held = ds.cache.entries._dir if ds.cache.in_ram else ds.cache.arena.folder
        return held.path

    folder = use_once()  # what the first read sets up for good (the store's I/O loop)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(4):
        assert use_once() == folder
        gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
    owners = {c.name: c.owners for c in list_caches()}
    assert os.getpid() not in owners[folder.name]


def test_make_loader_picks_the_block_sampler_beyond_ram_and_says_why(ct_store):
    lines: list[str] = []
    ds = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(20))
    loader, _ = make_loader(ds, 4, workers=0, log=lines.append)
    assert isinstance(loader.sampler.order, BlockSampler)  # the order behind the epoch keys
    assert "block shuffle" in lines[0] and "decoded >" in lines[0]
    got = torch.cat([b["image"] for b in loader])
    assert got.shape[0] == len(ds)
    loader, _ = make_loader(ds, 4, workers=0, log=lines.append, order="random")
    assert not isinstance(loader.sampler.order, BlockSampler)
    fits = CTPatchDataset(ct_store, cache_gb=1.0)
    assert not isinstance(make_sampler(fits), BlockSampler)
    assert isinstance(make_sampler(fits, "block"), BlockSampler)


# machine-wide hygiene ------------------------------------------------------------------------


def test_unused_caches_are_swept_by_age_and_cap_and_listed_and_cleared(
    ct_store, monkeypatch, capsys
):
    from zarrfeed.cli import main

    clear_caches()
    used = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(20))
    used[0]
    idle = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(24))
    idle[0]
    idle.cache.arena.folder.close()  # that run is over
    names = {c.name: c for c in list_caches()}
    assert os.getpid() in names[used.cache.arena.folder.path.name].owners
    monkeypatch.setenv("ZARRFEED_CACHE_MAX_AGE_H", "0")  # everything idle is too old
    removed = sweep()
    assert idle.cache.arena.folder.path.name in removed
    assert used.cache.arena.folder.path.exists()  # in use: never removed
    monkeypatch.setenv("ZARRFEED_CACHE_MAX_AGE_H", "24")
    other = CTPatchDataset(ct_store, cache_gb=unit_budget_gb(28))
    other[0]
    other.cache.arena.folder.close()
    monkeypatch.setenv("ZARRFEED_CACHE_CAP_GB", str(unit_budget_gb(22)))
    assert other.cache.arena.folder.path.name in sweep()  # over the cap: unused ones go
    assert main(["cache", "list"]) == 0
    assert used.cache.arena.folder.path.name in capsys.readouterr().out
    assert main(["cache", "clear", "--all"]) == 0
    assert "in use, kept" in capsys.readouterr().out
    assert used.cache.arena.folder.path.exists()
    assert main(["cache", "clear", "zarrfeed-arrays-typo"]) == 2  # a name that is no cache
    assert "no cache named zarrfeed-arrays-typo" in capsys.readouterr().err


def test_locks_are_released_when_their_holder_dies(tmp_path):
    path = tmp_path / "locks"
    path.touch()
    fd = os.open(path, os.O_RDWR)
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_hold, args=(str(path), ready))
    child.start()
    assert ready.wait(120), "the child never took the lock"
    assert not locks.lock(fd, 7, wait=False) and locks.held_by_other(fd, 7)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert locks.lock(fd, 7, wait=False)
    os.close(fd)


def _hold(path: str, ready) -> None:
    fd = os.open(path, os.O_RDWR)
    locks.lock(fd, 7)
    ready.set()
    time.sleep(600)


@pytest.mark.slow
def test_a_budget_of_a_few_batches_is_refused_in_one_line_or_holds_with_two_workers(tmp_path):
    store = build_ct(tmp_path / "store.zarr", n=16, shape=(64, 128, 256), per=16)
    ds = CTPatchDataset(store, cache_gb=unit_budget_gb(8))  # 16 batches of 4 × 32³ float16
    with pytest.raises(ConfigError) as refused:
        make_loader(ds, 4, workers=2, context="fork", log=None)
    message = str(refused.value)
    assert "\n" not in message and "or use workers=0" in message
    smallest = float(re.search(r"smallest cache_gb that works is ([\d.]+)", message)[1])
    loader, _ = make_loader(ds, 4, workers=0, log=None)  # the other way out it names
    assert sum(len(b["image"]) for b in loader) == len(ds)
    for _ in range(2):  # Shmem is machine-wide: a second try, should another process allocate
        ds = CTPatchDataset(store, cache_gb=smallest)
        clear_caches()
        rise, _ = _epoch_peaks(ds, workers=2)
        if rise <= 1.1 * ds.budget_bytes:
            break
    assert rise <= 1.1 * ds.budget_bytes, rise / ds.budget_bytes
