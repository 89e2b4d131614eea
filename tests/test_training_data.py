"""Training datasets, the shared cache and loader sizing, on a store built by the real assets."""

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import descendants, running
from torch.utils.data import DataLoader

from zarrfeed.errors import StoreError
from zarrfeed.families.ct.datasets import CTPatchDataset, SparsePointsDataset, collate_points
from zarrfeed.families.ct.tables import read_ct_rate_labels
from zarrfeed.families.images.datasets import ImagePatchDataset
from zarrfeed.families.spike.datasets import SpikeClipDataset
from zarrfeed.store import ZarrStore
from zarrfeed.training import Fill, SharedArrayCache, make_loader, plan_loader

CT_KEYS = ["train_1_a_1", "train_1_a_2", "train_2_a_1", "valid_1_a_1"]


@pytest.fixture
def cache_gb():
    return 0.25


def test_ct_patches_match_the_store_and_carry_labels(built, cache_gb):
    store, raw = built
    ds = CTPatchDataset(store, window="bone", cache_gb=cache_gb)
    assert ds.keys == CT_KEYS and len(ds) == len(ds.origins) > 0
    assert ds.items.dtype == np.uint32 and ds.origins.dtype == np.uint16  # compact, no objects
    for i in (0, len(ds) // 2, len(ds) - 1):
        sample = ds[i]
        key = CT_KEYS[sample["item"]]
        z, y, x = ds.origins[i].astype(int)
        want = store.open_array("ct/windows", key, "bone")[z : z + 16, y : y + 32, x : x + 32]
        np.testing.assert_array_equal(sample["image"][0].numpy(), want)
        names, rows = read_ct_rate_labels(raw)
        assert ds.label_names == names
        np.testing.assert_array_equal(sample["labels"].numpy(), np.array(rows[key], np.float32))
    whole = CTPatchDataset(store, window="lung", patch=False, cache_gb=cache_gb)
    assert whole[1]["image"].shape[1:] == tuple(
        store.open_array("ct/windows", CT_KEYS[1], "lung").shape
    )


def test_cache_is_shared_lru_and_byte_budgeted(tmp_path):
    entry = 8000 + 128  # 1000 float64 + the .npy header: the budget counts what RAM holds
    cache = SharedArrayCache(f"test-{tmp_path}", budget_bytes=3 * entry)
    arrays = {k: np.full(1000, i, dtype=np.float64) for i, k in enumerate("abcd")}  # 8 kB each
    for k in "abc":
        cache.get(k, lambda k=k: arrays[k])
    cache.get("a", lambda: pytest.fail("a is cached"))  # hit: a becomes the most recent
    cache.get("d", lambda: arrays["d"])  # over budget: evicts the least recently used, b
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["evictions"], stats["entries"]) == (1, 4, 1, 3)
    assert stats["bytes_held"] == 3 * entry
    loads = []
    cache.get("b", lambda: loads.append("b") or arrays["b"])
    assert loads == ["b"]
    # Another process (spawned: nothing inherited) sees the same entries and adds its hits.
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(1)
    try:
        assert pool.apply(_read_cached, (cache, "d")) == 3.0
    finally:  # close + join: the worker ends on its own, never relying on SIGTERM
        pool.close()
        pool.join()
    assert cache.stats()["hits"] == 2


def test_fill_decodes_in_place_within_budget_and_leaves_nothing_on_failure(tmp_path):
    entry = 8000 + 128
    cache = SharedArrayCache(f"fill-{tmp_path}", budget_bytes=2 * entry)

    def fill(value: float, fail: bool = False) -> Fill:
        def into(out: np.ndarray) -> None:
            out[:500] = value
            if fail:
                raise OSError("disk went away")
            out[500:] = value

        return Fill((1000,), np.dtype("f8"), into)

    for i, k in enumerate("abc"):
        got = cache.get(k, fill(i))
        assert not got.flags.writeable and (got == i).all()
    assert cache.stats()["entries"] == 2 and cache.stats()["evictions"] == 1
    np.testing.assert_array_equal(np.load(cache._path("c")), np.full(1000, 2.0))
    with pytest.raises(OSError, match="went away"):
        cache.get("d", fill(3, fail=True))
    left = [p for p in cache.folder.iterdir() if p.suffix in (".npy", ".tmp")]
    assert {p.suffix for p in left} == {".npy"} and not cache._path("d").exists()
    big = cache.get("e", Fill((3000,), np.dtype("f8"), lambda out: out.fill(7)))
    assert big.flags.writeable and (big == 7).all()  # over the budget: served uncached
    assert cache.stats()["entries"] == len(left)


def _read_cached(cache, key):
    return float(cache.get(key, lambda: pytest.fail("should be cached"))[0])


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
@pytest.mark.parametrize("cache_gb", [0.25, 0.012], ids=["in-RAM", "out-of-core"])
def test_workers_read_identically_under_every_start_method(built, context, cache_gb):
    store, _ = built
    ds = CTPatchDataset(store, window="lung", cache_gb=cache_gb)
    assert ds.cache.in_ram == (cache_gb > 0.1)
    ds.cache.clear()
    expected = [ds[i]["image"] for i in range(8)]  # the parent has opened and read the store
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context=context, collate_fn=ds.collate
    )
    got = torch.cat([b["image"] for _, b in zip(range(2), loader, strict=False)])
    torch.testing.assert_close(got, torch.stack(expected))
    stats = ds.cache.stats()
    assert stats["entries"] <= len(CT_KEYS) if ds.cache.in_ram else stats["hits"] > 0


def test_preload_fills_the_shared_cache_once(built):
    store, _ = built
    ds = CTPatchDataset(store, window="lung", cache_gb=0.25)
    ds.cache.clear()
    ds[0]  # the parent has read the store (zarr's I/O thread is running)
    ds.preload()
    stats = ds.cache.stats()
    assert stats["entries"] == len(CT_KEYS) and stats["bytes_held"] >= ds.nbytes()
    volume = store.open_array("ct/windows", CT_KEYS[1], "lung")[...]
    np.testing.assert_array_equal(ds.array(1, "lung"), volume)
    assert ds.cache.stats()["hits"] > stats["hits"]  # served from the cache


def test_sparse_points_sampling_and_collate(built):
    store, _ = built
    ds = SparsePointsDataset(store, window="bone", min_points=4, max_points=50)
    batch = collate_points([ds[i] for i in range(len(ds))])
    assert batch["coords"].shape[1] == 4 and (batch["counts"] <= 50).all()
    owners = np.repeat(np.arange(len(batch["counts"])), batch["counts"].numpy())
    np.testing.assert_array_equal(batch["coords"][:, 0].numpy(), owners)
    assert torch.equal(ds[0]["coords"], ds[0]["coords"])  # deterministic per (seed, epoch, index)
    with pytest.raises(StoreError, match="10000000 points"):
        SparsePointsDataset(store, window="bone", min_points=10_000_000, max_points=10_000_001)


def test_spike_clips_realtime_voxels_equal_stored(built):
    store, _ = built
    stored = SpikeClipDataset(store, clip_len=3, crop=(48, 64), voxels="stored", cache_gb=0.1)
    realtime = SpikeClipDataset(store, clip_len=3, crop=(48, 64), voxels="realtime", cache_gb=0.1)
    assert len(stored) == 2 * (6 - 3 + 1)
    for i in range(len(stored)):
        a, b = stored[i], realtime[i]
        for name in ("blur", "sharp", "voxels"):
            assert torch.equal(a[name], b[name]), name
    assert a["blur"].shape == (3, 3, 48, 64) and a["voxels"].shape == (3, 5, 48, 64)


def test_image_patches_crop_first_with_defects_and_mask(built):
    store, _ = built
    ds = ImagePatchDataset(store, defects=True, cache_gb=0.1)
    plain = ImagePatchDataset(store, defects=False, cache_gb=0.1)
    s, p = ds[3], plain[3]
    assert s["image"].shape == (3, 128, 128) and s["mask"].shape == (1, 128, 128)
    assert set(np.unique(s["mask"].numpy())) <= {0, 1}
    torch.testing.assert_close(s["image"][1:], p["image"][1:])  # defects only on channel 0
    changed = (s["image"][0] != p["image"][0]).numpy()
    assert not s["mask"].numpy()[0][~changed].any()  # the mask lies inside the defects


def test_loader_plan_follows_cpus_dataset_size_and_spec(built, monkeypatch):
    from zarrfeed.training.data import facts

    monkeypatch.setattr(facts, "cpu_budget", lambda: (40, "test"))
    assert plan_loader(10_000, 8, "auto").num_workers == 32  # seed 001: 40 CPUs → 32
    assert plan_loader(10_000, 8, "cpu*0.9").num_workers == 36
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert plan_loader(10_000, 8, "auto").num_workers == 10  # per GPU, like seed 001's log
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    small = plan_loader(20, 2, "auto")
    assert small.num_workers == 2 and any("small dataset" in r for r in small.reasons)
    assert plan_loader(10_000, 8, 5).num_workers == 5
    assert plan_loader(10_000, 8, 0).context is None
    with pytest.raises(ValueError, match="'auto', 'cpu\\*<fraction>' or an integer"):
        plan_loader(100, 8, "many")
    store, _ = built
    lines = []
    make_loader(CTPatchDataset(store, cache_gb=0.25), 4, workers=0, log=lines.append)
    assert "data loading configuration" in lines[0] and "preloaded" in lines[0]


def test_errors_name_the_store_asset_and_partition(built, tmp_path):
    store, _ = built
    with pytest.raises(StoreError, match=f"{tmp_path} has no ct_dataset manifest"):
        CTPatchDataset(str(tmp_path))
    copy = tmp_path / "copy.zarr"
    shutil.copytree(store.root, copy)
    ds = CTPatchDataset(str(copy), window="bone", cache_gb=0.05)
    version = ZarrStore(copy).commit_record("ct/windows", CT_KEYS[0])["version"]
    chunks = Path(copy, "ct/windows", CT_KEYS[0], version, "bone/c")
    for chunk in chunks.rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(b"garbage")
    loader = DataLoader(
        ds, batch_size=2, num_workers=1, multiprocessing_context="fork", collate_fn=ds.collate
    )
    with pytest.raises(RuntimeError, match=f"ct/windows of {copy}"):
        next(iter(loader))
    ds.partitions[1]["arrays"]["bone"]["shape"] = [1, 2, 3]
    with pytest.raises(RuntimeError, match=f"partition ct/windows/{CT_KEYS[1]} .*manifest says"):
        ds[int(np.flatnonzero(ds.items == 1)[0])]


def test_a_forked_child_opens_its_own_store(built):
    store, _ = built
    ds = CTPatchDataset(store, cache_gb=0.01)
    first = ds.store
    pid = os.fork()
    if pid == 0:  # the child: a store of its own, kept for its next use
        os._exit(0 if ds.store is not first and ds.store is ds.store else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert ds.store is first


def test_autotune_measures_and_remembers(built, tmp_path):
    from zarrfeed.training import autotune

    store, _ = built
    ds = CTPatchDataset(store, cache_gb=0.25)
    memo = tmp_path / "autotune.json"
    plan = autotune(ds, 4, candidates=[0, 1], batches=3, context="fork", remember=memo)
    assert plan.num_workers in (0, 1) and "autotune: 0 workers" in plan.reasons[-1]
    again = autotune(ds, 4, candidates=[0, 1], batches=3, context="fork", remember=memo)
    assert again.num_workers == plan.num_workers and "remembered" in again.reasons[-1]


def test_benchmark_loader_cli_reports_throughput_cache_and_advice(built, capsys):
    from zarrfeed.cli import main

    store, _ = built
    assert (
        main(
            [
                "benchmark-loader",
                "--store",
                store.url,
                "--dataset",
                "images",
                "--batch",
                "4",
                "--batches",
                "5",
                "--workers",
                "1",
                "--cache-gb",
                "0.1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "data loading configuration" in out and "samples/s" in out
    assert "hits" in out and "recommendation:" in out
    assert main(["benchmark-loader", "--store", str(Path(store.url).parent / "none.zarr")]) == 2


def test_patch_is_read_directly_while_another_process_fills_its_volume(built):
    from zarrfeed import locks

    store, _ = built
    ds = CTPatchDataset(store, window="lung", cache_gb=0.25)
    ds.cache.clear()
    entries = ds.cache.entries
    digest = entries._digest(ds.cache.entry_key(ds.asset, 0, "lung"))
    other = os.open(entries.folder / "locks", os.O_RDWR)  # as if another worker were decoding
    assert locks.lock(other, entries._lock_byte(digest), wait=False)
    i = int(np.flatnonzero(ds.items == 0)[0])
    z, y, x = ds.origins[i].astype(int)
    want = store.open_array("ct/windows", CT_KEYS[0], "lung")[z : z + 16, y : y + 32, x : x + 32]
    np.testing.assert_array_equal(ds[i]["image"][0].numpy(), want)
    assert ds.cache.stats()["entries"] == 0  # served without waiting and without caching
    os.close(other)


OWNER = """
import sys, time
from zarrfeed.store import ZarrStore
from zarrfeed.training import make_loader
from zarrfeed.families.ct.datasets import CTPatchDataset
ds = CTPatchDataset(ZarrStore(sys.argv[1]), window="lung", cache_gb=0.25)
loader, _ = make_loader(ds, 2, workers=2, log=None)
next(iter(loader))
print("reading", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_workers_end_when_their_trainer_is_killed(built):
    """forkserver workers are the fork server's children and keep it open: a SIGKILLed
    (or OOM-killed) trainer must still take them, and the shared memory they map, along."""
    store, _ = built
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(store.url)], stdout=subprocess.PIPE)
    try:
        assert owner.stdout.readline() == b"reading\n"
        left = descendants(owner.pid)
        assert len(left) >= 3, left  # the fork server and two workers
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 30
    while (alive := [p for p, _ in left if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, [cmd for p, cmd in left if p in alive]
