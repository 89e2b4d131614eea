"""Loader benchmarks: zarrfeed's cached Datasets against the loaders users had before.

In RAM (issue 5): four 240×480×480 float16 volumes, an epoch of 512 random 64³ patches
(128 per volume), batch 8; 976×176×3 images with 128×128 crops.  Out of core (issue 12):
eight such volumes (0.88 GB decoded) through a 0.25 GB cache, an epoch of 1,024 patches.
Each loader runs at its best worker count (0, 1 or 2 on this machine), except the warm
cache against ``np.load(mmap)``: that one is measured at 0 workers and at one worker per
usable core, both sides at the same count, so a machine with many cores shows whether the
host path keeps up.  All in one run; every ratio compares two loaders measured side by side:

    python benchmarks/loaders.py           # the full scenario (~12 min on 2 cores)
    python benchmarks/loaders.py --quick   # small volumes, 32 patches per volume in RAM,
                                           # one turn per rate, no spike clips (CI smoke run)
"""

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import zarr
from _bench import bench
from torch.utils.data import DataLoader, Dataset

from zarrfeed.datasets import Retention, consolidate, snapshots, write_dataset
from zarrfeed.errors import ConfigError
from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.families.spike.datasets import SpikeClipDataset
from zarrfeed.processes import usable_cpus
from zarrfeed.store import ZarrStore, provenance
from zarrfeed.training import SharedArrayCache, make_loader
from zarrfeed.training.data import GB
from zarrfeed.training.data.facts import Budgets
from zarrfeed.training.data.feed import make_feed
from zarrfeed.training.data.shm import clear_caches

PATCH, PER_VOLUME, BATCH = 64, 128, 8


def make_volumes(
    root: Path,
    shape: tuple[int, int, int],
    n: int = 4,
    name: str = "store.zarr",
    per_volume: int = PER_VOLUME,
) -> ZarrStore:
    """A store as the CT assets leave it: windows, patch indexes, manifest, consolidated index."""
    store = ZarrStore(root / name)
    rng = np.random.default_rng(0)
    keys = [f"vol_{i}" for i in range(n)]
    for key in keys:
        base = rng.random((shape[0] // 8, shape[1] // 8, shape[2] // 8), dtype=np.float32)
        vol = np.kron(base, np.ones((8, 8, 8), np.float32))  # smooth, like a windowed CT
        vol += rng.normal(0, 0.02, vol.shape).astype(np.float32)
        vol = np.clip(vol, 0, 1).astype(np.float16)
        with store.write_partition("ct/windows", key, provenance("bench", None, "1")) as w:
            w.write("lung", vol)
        origins = np.stack([rng.integers(0, s - PATCH + 1, per_volume) for s in shape], 1)
        attrs = provenance("bench", None, "1", patch_shape=[PATCH] * 3)
        with store.write_partition("ct/patches", key, attrs) as w:
            w.write("origins", origins.astype(np.uint16), read="rows")
            w.write("fraction", np.ones(per_volume, np.float32), read="rows")
        np.save(root / f"{key}.npy", vol)  # the usual baseline: uncompressed .npy, mmap'd
    listed = write_dataset(store, "ct", ["ct/windows", "ct/patches"])["keys"]  # sorted
    consolidate(store, "ct", "ct/patches", listed, ["origins", "fraction"], table="patches")
    return store


class MmapPatches(Dataset):
    """Seed 000: ``np.load(mmap_mode="r")`` per volume, opened lazily in each worker."""

    def __init__(self, files: list[Path], items: np.ndarray, origins: np.ndarray) -> None:
        self.files, self.items, self.origins, self.arrays = files, items, origins, {}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        item = int(self.items[i])
        if item not in self.arrays:
            self.arrays[item] = np.load(self.files[item], mmap_mode="r")
        z, y, x = (int(o) for o in self.origins[i])
        patch = self.arrays[item][z : z + PATCH, y : y + PATCH, x : x + PATCH]
        return {"image": torch.from_numpy(np.array(patch))[None], "item": item}


class ZarrPatches(MmapPatches):
    """A plain per-sample ``zarr`` read in ``__getitem__`` (no cache)."""

    def __getitem__(self, i: int) -> dict:
        item = int(self.items[i])
        if item not in self.arrays:
            self.arrays[item] = zarr.open_array(self.files[item], mode="r")
        z, y, x = (int(o) for o in self.origins[i])
        patch = self.arrays[item][z : z + PATCH, y : y + PATCH, x : x + PATCH]
        return {"image": torch.from_numpy(patch)[None], "item": item}


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)  # as zarrfeed's own workers: side by side, one thread each


def epoch_rate(dataset: Dataset, workers: int, epochs: int = 1, **kw) -> float:
    """Patches per second over whole epochs (after one warm-up batch), shuffled, batch 8."""
    extra = (
        {
            "multiprocessing_context": "fork",
            "persistent_workers": True,
            "worker_init_fn": _one_thread,
        }
        if workers
        else {}
    )
    collate = getattr(dataset, "collate", None)  # zarrfeed collates whole batches in workers
    loader = DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate,
        **extra,
        **kw,
    )
    iter(loader).__next__()  # start the workers
    t0, n = time.perf_counter(), 0
    for _ in range(epochs):
        for batch in loader:
            n += len(batch["item"]) if isinstance(batch, dict) else len(batch)
    return n / (time.perf_counter() - t0)


def best(make, label: str, repeats: int = 2) -> tuple[float, int]:
    """The best rate over 0 (loading in the main process), 1 and 2 workers, each the best of
    ``repeats`` (this VM is shared)."""
    rates = {w: max(epoch_rate(make(), w) for _ in range(repeats)) for w in (0, 1, 2)}
    w = max(rates, key=rates.get)
    print(
        f"# {label}: " + ", ".join(f"{k} workers {v:.0f}/s" for k, v in rates.items()), flush=True
    )
    return rates[w], w


def ct_loaders(
    work: Path,
    shape: tuple[int, int, int],
    per_volume: int = PER_VOLUME,
    repeats: int = 2,
    memcpy_s: float = 0.5,
) -> None:
    """Four volumes in RAM: each rate the best of ``repeats`` turns, the memcpy limit
    measured over ``memcpy_s`` seconds a turn."""
    store = make_volumes(work, shape, per_volume=per_volume)
    ds = CTPatchDataset(store, window="lung", cache_gb=2.0)
    ds.cache.clear()
    npy = [work / f"{k}.npy" for k in ds.keys]
    zarrs = [store.version_path("ct/windows", k) + "/lung" for k in ds.keys]

    # Cold: an empty cache; the first epoch pays preloading (decode into fresh /dev/shm pages,
    # whose first touch on this VM varies 2x from run to run: best of the turns, like the rest).
    preload_s = float("inf")
    for _ in range(repeats):
        ds.cache.clear()  # entries, statistics and this process's mappings
        t0 = time.perf_counter()
        ds.preload()
        preload_s = min(preload_s, time.perf_counter() - t0)
    first_epoch = {w: epoch_rate(ds, w) for w in (0, 1, 2)}  # at its best worker count
    cold = len(ds) / (preload_s + len(ds) / max(first_epoch.values()))
    zarr_rate, zw = best(lambda: ZarrPatches(zarrs, ds.items, ds.origins), "plain zarr", repeats)
    bench(
        "loader.cold_vs_zarr",
        cold / zarr_rate,
        "x",
        f"first epoch incl. preload ({preload_s:.2f}s) {cold:.0f}/s vs per-sample zarr "
        f"{zarr_rate:.0f}/s "
        f"({zw} workers)",
    )

    warm, ww = cached_vs_mmap(ds, npy, repeats)
    npy_bytes = sum(p.stat().st_size for p in npy)
    stored = sum(store.commit_record("ct/windows", k)["stored_bytes"] for k in ds.keys)
    bench(
        "loader.disk_ratio",
        npy_bytes / stored,
        "x",
        f"npy {npy_bytes / 1e6:.0f} MB / store {stored / 1e6:.0f} MB",
    )
    bench("loader.zarrfeed_warm_patches_per_s", warm, "patches/s", f"{ww} workers, 64^3 float16")
    copies = memcpy_rate(memcpy_s)
    bench(
        "loader.warm_vs_memcpy",
        warm / copies,
        "x",
        f"warm {warm:.0f} patches/s vs {copies:.0f} memcpys/s of 512 KB on one core (a 64^3 "
        "float16 patch, copied from anywhere in 256 MB)",
    )
    monai_torchio(work, ds, npy, warm, per_volume, repeats)


def feed_rate(ds: CTPatchDataset, workers: int, epochs: int = 2) -> float:
    """Patches per second as the trainer gets them: the pipelined feed's DataLoader path on
    the CPU (workers write into reused batch slots; the feed copies each batch out)."""
    budgets = Budgets(BATCH, workers=workers, order="random", device_cache="off", context="fork")
    feed = make_feed(ds, torch.device("cpu"), budgets, log=None)
    feed.begin(0, 0)
    try:
        feed.next()  # the workers are up
        t0, n = time.perf_counter(), 0
        for _ in range(epochs * feed.per_epoch):
            n += len(feed.next()[1]["item"])
        return n / (time.perf_counter() - t0)
    finally:
        feed.close()


def cached_vs_mmap(ds: CTPatchDataset, npy: list[Path], repeats: int = 2) -> tuple[float, int]:
    """Warm cache against ``np.load(mmap)`` at 0 workers and at one worker per usable core,
    both sides at the same count (the best of ``repeats`` each): the host path must keep up
    however many cores there are.  Returns zarrfeed's best rate and its worker count."""
    cores, rates = usable_cpus(), {}
    for workers in (0, cores):
        ours = max(feed_rate(ds, workers) for _ in range(repeats))
        theirs = max(
            epoch_rate(MmapPatches(npy, ds.items, ds.origins), workers, epochs=2)
            for _ in range(repeats)
        )
        rates[workers] = ours, theirs
        name = "main" if workers == 0 else "workers"
        bench(
            f"loader.cached_vs_mmap.{name}",
            ours / theirs,
            "x",
            f"zarrfeed (the training feed) {ours:.0f}/s vs np.load(mmap) {theirs:.0f}/s, "
            f"{workers} workers each, {cores} usable cores",
        )
    worst = min(rates, key=lambda w: rates[w][0] / rates[w][1])
    bench(
        "loader.cached_vs_mmap",
        rates[worst][0] / rates[worst][1],
        "x",
        f"the lower of the two above ({worst} workers)",
    )
    best_workers = max(rates, key=lambda w: rates[w][0])
    return rates[best_workers][0], best_workers


def memcpy_rate(seconds: float = 0.5) -> float:
    """512 KB copies per second on one core from random places of a 256 MB buffer (best of
    three): the physical limit of cutting patches out of RAM."""
    src, dst = np.ones(256 << 20, np.uint8), np.empty(512 << 10, np.uint8)
    starts = np.random.default_rng(0).integers(0, len(src) - len(dst), 4096) // 4096 * 4096
    best_rate = 0.0
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for s in starts[n % 4096 : n % 4096 + 64]:
                np.copyto(dst, src[s : s + len(dst)])
            n += 64
        best_rate = max(best_rate, n / (time.perf_counter() - t0))
    return best_rate


def shmem() -> int:
    """Shared memory the kernel holds on this machine (``Shmem`` in /proc/meminfo), bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


def ooc_epoch(store: ZarrStore, budget_gb: float, workers: int) -> tuple[float, int, int]:
    """One cold epoch through ``make_loader`` (block sampler, fork workers started first):
    (patches/s, peak rise of Shmem from before the cache existed, bytes decoded)."""
    base, peak, stop = shmem(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], shmem() - base)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ds = CTPatchDataset(store, window="lung", cache_gb=budget_gb)
    try:
        loader, _ = make_loader(ds, BATCH, workers=workers, context="fork", log=None)
    except ConfigError:  # batches in flight would not fit the budget beside the cache
        stop.set()
        sampler.join()
        ds.cache.close()
        clear_caches([ds.cache.arena.folder.path.name])
        raise
    next(iter(loader))  # start the workers
    it = iter(loader)  # the timed epoch: its first batches are already being read
    ds.cache.clear()  # cold: nothing decoded, statistics at zero
    t0, n = time.perf_counter(), 0
    for batch in it:
        n += len(batch["item"])
    rate = n / (time.perf_counter() - t0)
    decoded = ds.cache.stats()["bytes_decoded"]
    stop.set()
    sampler.join()
    del it, loader
    ds.cache.close()
    clear_caches([ds.cache.arena.folder.path.name])  # the next run starts without it
    return rate, peak[0], decoded


def beyond_ram(
    work: Path, shape: tuple[int, int, int], budget_gb: float, per_volume: int, repeats: int
) -> None:
    """Eight volumes through a cache that holds about a third of them."""
    store = make_volumes(work, shape, n=8, name="ooc.zarr", per_volume=per_volume)
    ds = CTPatchDataset(store, window="lung", cache_gb=budget_gb)
    dataset_bytes, budget = ds.nbytes(), ds.budget_bytes
    zarrs = [store.version_path("ct/windows", k) + "/lung" for k in ds.keys]
    zarr_rate, zw = best(
        lambda: ZarrPatches(zarrs, ds.items, ds.origins), "plain zarr (8 volumes)", repeats
    )
    runs = {}
    for w in (0, 1, 2):
        try:
            runs[w] = ooc_epoch(store, budget_gb, w)
        except ConfigError as refused:  # the budget holds no batch in flight for w workers
            print(f"# zarrfeed out of core, {w} workers refused: {refused}", flush=True)
    print(
        "# zarrfeed out of core: "
        + ", ".join(
            f"{w} workers {r:.0f}/s (Shmem +{p / 1e6:.0f} MB, decoded {d / 1e9:.2f} GB)"
            for w, (r, p, d) in runs.items()
        ),
        flush=True,
    )
    w = max(runs, key=lambda k: runs[k][0])
    rate, peak, decoded = runs[w]
    setting = (
        f"{len(ds)} patches of 64^3 from 8 volumes {'x'.join(map(str, shape))} float16 "
        f"({dataset_bytes / 1e9:.2f} GB decoded), {budget / 1e9:.2f} GB cache, {w} workers"
    )
    versus = f"zarrfeed {rate:.0f}/s vs per-sample zarr {zarr_rate:.0f}/s ({zw} workers)"
    bench("loader.ooc_vs_zarr", rate / zarr_rate, "x", f"{versus}; {setting}")
    worst = max(p for _, p, _ in runs.values()) / budget
    bench(
        "loader.ooc_shm_peak_over_budget",
        peak / budget,
        "x",
        f"peak rise of Shmem {peak / 1e6:.0f} MB: cache + batches in flight (worst over "
        f"worker counts {worst:.2f})",
    )
    bench(
        "loader.ooc_decoded_over_dataset",
        decoded / dataset_bytes,
        "x",
        f"{decoded / 1e9:.2f} GB decoded in the epoch (64^3 units; edge units padded)",
    )
    bench("loader.ooc_patches_per_s", rate, "patches/s", setting)


def monai_torchio(
    work: Path, ds: CTPatchDataset, npy: list[Path], warm: float, per_volume: int, repeats: int
) -> None:
    try:
        import monai.data as md
        import monai.transforms as mt
        import torchio as tio
    except ImportError:
        print("# MONAI / TorchIO not installed (pip install -e .[bench]): loader.vs_* skipped")
        return
    from zarrfeed.formats import write_nifti

    files = []
    for p in npy:  # the same volumes as .nii.gz, the input those libraries expect
        path = work / f"{p.stem}.nii"  # uncompressed: their cache fill is not what we time
        write_nifti(path, np.load(p).astype(np.float32), (1.5, 0.75, 0.75))
        files.append(str(path))

    def monai_ds(copy_cache: bool = False):
        chain = mt.Compose(
            [
                mt.LoadImaged("image", image_only=True),
                mt.EnsureChannelFirstd("image"),
                mt.RandSpatialCropd("image", (PATCH,) * 3, random_size=False),
            ]
        )
        # CacheDataset caches up to the first random transform; the crop runs per sample.
        cached = md.CacheDataset(
            [{"image": f} for f in files],
            chain,
            cache_rate=1.0,
            num_workers=2,
            copy_cache=copy_cache,
            progress=False,
        )
        return MonaiPatches(cached, len(files) * per_volume)

    monai_rate, w = best(monai_ds, "MONAI CacheDataset + RandSpatialCrop", repeats)
    bench(
        "loader.vs_monai",
        warm / monai_rate,
        "x",
        f"MONAI copy_cache=False (its fastest) {monai_rate:.0f}/s ({w} workers)",
    )
    default_rate, w = best(lambda: monai_ds(copy_cache=True), "MONAI defaults", repeats=1)
    bench(
        "loader.vs_monai_default",
        warm / default_rate,
        "x",
        f"MONAI default copy_cache=True {default_rate:.0f}/s ({w} workers)",
    )

    def torchio_rate() -> float:
        subjects = tio.SubjectsDataset([tio.Subject(image=tio.ScalarImage(f)) for f in files])
        queue = tio.Queue(
            subjects,
            max_length=per_volume,
            samples_per_volume=per_volume // 2,
            sampler=tio.UniformSampler(PATCH),
            num_workers=2,
            shuffle_subjects=True,
            shuffle_patches=True,
            verbose=False,
        )
        loader = DataLoader(queue, batch_size=BATCH, num_workers=0)  # TorchIO: must be 0
        t0, seen = time.perf_counter(), 0
        for batch in loader:
            seen += len(batch["image"][tio.DATA])
        return seen / (time.perf_counter() - t0)

    tio_rate = torchio_rate()
    print(f"# TorchIO Queue + UniformSampler: {tio_rate:.0f}/s (2 queue workers)")
    bench("loader.vs_torchio", warm / tio_rate, "x", f"TorchIO {tio_rate:.0f}/s")


class MonaiPatches(Dataset):
    """An epoch of ``n`` samples over MONAI's CacheDataset of the volumes (``i % volumes``)."""

    def __init__(self, cached: Dataset, n: int) -> None:
        self.cached, self.n = cached, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        item = i % len(self.cached)
        return {"image": torch.as_tensor(self.cached[item]["image"]), "item": item}


def pss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total / 1024


class TouchEntries(Dataset):
    """Sample i reads cache entry i // workers in full, so every worker maps every entry."""

    def __init__(self, cache: SharedArrayCache, keys: list[str], workers: int) -> None:
        self.cache, self.keys, self.workers = cache, keys, workers

    def __len__(self) -> int:
        return len(self.keys) * self.workers

    def __getitem__(self, i: int) -> int:
        arr = self.cache.get(self.keys[i // self.workers], lambda: None)
        return int(arr[:: 4096 // arr.itemsize].sum() >= 0)  # touch every page


def pss(work: Path, fill_gb: float) -> None:
    """Run in a fresh interpreter, so earlier benchmarks' memory does not count."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, __file__, "--pss", str(fill_gb), str(work)],
        capture_output=True,
        text=True,
        check=True,
    )
    print(out.stdout.strip())


def pss_child(work: Path, fill_gb: float) -> None:
    cache = SharedArrayCache(f"pss-{work}", int(fill_gb * GB) + (64 << 20))
    keys = [f"block{i}" for i in range(int(fill_gb * 8))]
    for k in keys:  # 128 MiB entries
        cache.get(k, lambda: np.ones(16 << 20, dtype=np.float64))
    loader = DataLoader(
        TouchEntries(cache, keys, 4),
        batch_size=1,
        num_workers=4,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    it = iter(loader)
    for _ in range(len(keys) * 4):
        next(it)
    pids = [os.getpid(), *(w.pid for w in it._workers)]
    value = pss_mb(pids)
    bench(
        "loader.pss_mb",
        value,
        "MB",
        f"main + 4 workers, {fill_gb:g} GB cache filled and read by all (per-worker copies: "
        f"{5 * fill_gb * 1024:.0f})",
    )
    del it, loader
    cache.clear()


def spike(work: Path) -> None:
    import dagster as dg

    from zarrfeed.assets import family_assets
    from zarrfeed.assets.datasets import dataset_asset
    from zarrfeed.families.spike import SPIKE
    from zarrfeed.jobs.discovery import discover_into
    from zarrfeed.resources import BuildOptions, RawFolderResource, ZarrStoreResource
    from zarrfeed.samples import make_gopro_spike

    raw = work / "spike_raw"
    list(make_gopro_spike(raw / "gopro-spike", 2, 8, "full", np.random.default_rng(0)))
    res = {
        "build": BuildOptions(),
        "raw": RawFolderResource(root=str(raw)),
        "zarr_store": ZarrStoreResource(url=str(work / "spike.zarr")),
    }
    (work / "home").mkdir(exist_ok=True)
    with dg.instance_for_test(temp_dir=str(work / "home")) as instance:
        keys = discover_into(instance, SPIKE, res["raw"], res["zarr_store"])
        for k in keys:
            assets = family_assets(SPIKE, {})
            dg.materialize(assets, partition_key=k, resources=res, instance=instance)
        dg.materialize([dataset_asset(SPIKE)], resources=res, instance=instance)
    rates = {}
    for mode in ("stored", "realtime"):
        ds = SpikeClipDataset(str(work / "spike.zarr"), clip_len=3, crop=(256, 256), voxels=mode)
        ds.cache.clear()
        ds.preload()
        rates[mode] = epoch_rate(ds, 2, epochs=3)
    bench(
        "loader.spike_realtime_vs_stored",
        rates["realtime"] / rates["stored"],
        "x",
        f"realtime {rates['realtime']:.0f} clips/s vs stored voxels {rates['stored']:.0f} clips/s "
        "(396x640, 3-sample clips, 256 crops, 2 workers)",
    )


def init_10k(work: Path, n: int) -> None:
    """Dataset construction over n partitions: one manifest and one consolidated table."""
    store = ZarrStore(work / "many.zarr")
    keys = [f"scan_{i:05d}" for i in range(n)]
    part = {"arrays": {"lung": {"shape": [240, 480, 480], "dtype": "float16"}}}
    rng = np.random.default_rng(0)
    with store.write_partition("ct/patches", keys[0], {"patch_shape": [64, 64, 64]}) as w:
        w.write("origins", np.zeros((1, 3), np.uint16), read="rows")
    # Only the first patches partition is read (its patch_shape); the others are named at a
    # version that was never written, as every manifest entry names its version.
    first = store.commit_record("ct/patches", keys[0])["version"]
    unwritten = "v-never-written"
    versions = [first] + [unwritten] * (n - 1)
    manifest = {
        "dataset": "ct",
        "keys": keys,
        "incomplete": [],
        "assets": {
            "ct/windows": {"partitions": [dict(part, key=k, version=unwritten) for k in keys]},
            "ct/patches": {
                "partitions": [
                    {"key": k, "version": v} for k, v in zip(keys, versions, strict=True)
                ]
            },
        },
    }
    with store.write_partition("datasets/ct", "patches", {"keys": keys}) as w:
        w.write("offsets", np.arange(0, 128 * n + 1, 128, dtype=np.int64), read="whole")
        w.write("origins", rng.integers(0, 176, (128 * n, 3)).astype(np.uint16), read="rows")
    # A snapshot naming n partitions that were never written: the dataset's index is built
    # from the manifest and the table alone, which is what is measured.
    tables = {"patches": store.commit_record("datasets/ct", "patches")["version"]}
    digest = hashlib.sha256(json.dumps(manifest).encode()).hexdigest()
    snapshots(store).publish(
        "ct", digest, tables, Retention(), lambda head: json.dumps({**manifest, **head}).encode()
    )
    t0 = time.perf_counter()
    ds = CTPatchDataset(store, cache_gb=0.01)
    seconds = time.perf_counter() - t0
    bench(
        "loader.init_10k_partitions_s",
        seconds,
        "s",
        f"{n} partitions, {len(ds)} patches; index {ds.items.nbytes + ds.origins.nbytes} bytes",
    )
    manifest_size = len(json.dumps(manifest))
    print(f"# manifest {manifest_size / 1e6:.1f} MB JSON")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small inputs (smoke run)")
    parser.add_argument("--pss", nargs=2, metavar=("GB", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pss:
        pss_child(Path(args.pss[1]), float(args.pss[0]))
        return
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    os.environ["ZARRFEED_CACHE_ROOT"] = str(work / "caches")  # removed with everything else
    try:
        if args.quick:
            ct_loaders(work, (96, 128, 128), per_volume=32, repeats=1, memcpy_s=0.1)
        else:
            ct_loaders(work, (240, 480, 480))
        if args.quick:  # the same proportions: 75 MB decoded through a 21 MB cache
            beyond_ram(work, (128, 192, 192), 0.02, per_volume=32, repeats=1)
        else:
            beyond_ram(work, (240, 480, 480), 0.25, per_volume=128, repeats=2)
        pss(work, 0.25 if args.quick else 2.0)
        if not args.quick:
            spike(work)
        init_10k(work, 1000 if args.quick else 10_000)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
