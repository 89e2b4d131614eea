"""GPU feed benchmark: how close each data regime comes to the GPU's own limit.

The CT classifier at batch 32 of 64³ patches on CT-RATE-sized scans built through the CT
graph, trained by the real trainer, in four regimes, and the defect segmenter in a fifth:

* ``fits`` — the volumes fit the device budget: held on the device, cut there;
* ``device_quarter`` — the device budget is a quarter of the dataset: a pool of cache-unit
  slots on the device, fed from the host cache in RAM;
* ``host_quarter`` — the host cache budget is a quarter of the dataset too: the same pool,
  fed from the out-of-core arena;
* ``augmented`` — as ``fits``, with the CT task's default augmentation on (``data.augment``:
  flips, quarter turns, a small affine, intensity and noise), batched on the device after the
  gather;
* ``images`` — defect segmentation (``defect_segmentation``) on 128×128 patches of sample
  inspection images built through the image graph: the images held on the device, the
  patches cut and their local defects drawn there.

For each it prints ``gpu.wait_share.<regime>`` (share of the steady steps' wall time spent
waiting for data) and ``gpu.samples_vs_limit.<regime>``: samples/s over the regime's limit,
the same task, model, optimiser, precision and augmentation stepping on one batch already on
the device.  The limit steps through the trainer's own step (``zarrfeed.training.step``)
and gets its batch through the trainer's feed (its producer thread, where the augmentation
runs, and its side stream), so it cannot step differently from the trainer.  On CUDA the
limit runs right after each training, over its wall time.  On a CPU it takes one step
before each of the trainer's, in the same thread at the threads the trainer set, and both
are rated per median step: a shared CPU stretches some steps many times over, and only
steps taken side by side see the same load.  Each regime runs ``--repeat`` times (3 with
``--quick``); the best run and the best limit are compared.  Then ``gpu.vs_monai``: the
``fits`` regime's samples/s over its wall time against MONAI's fast-training recipe
(``CacheDataset`` + ``ToDeviced`` + ``ThreadDataLoader``, random crops of the same patch size)
on the same volumes and model, and ``gpu.vs_monai.augmented``: ``augmented`` against the same
with MONAI's ``RandFlipd``, ``RandRotate90d`` and ``RandAffined`` (and intensity and noise) on
the device tensors after the crop.

    python benchmarks/gpu.py --device cuda            # 16 full-size scans and 32 inspection
                                                      # images, batch 32, 400 steps
    python benchmarks/gpu.py --device cpu --quick     # the same code paths on small data (CI):
                                                      # 4 small scans at 2x1x1 mm, 4 images,
                                                      # batch 4, 12 steps, 3 runs a regime

On a GPU machine without internet (Python 3.12 with torch, numpy and scipy, but no Dagster,
Zarr or MONAI): first, where the package registry answers, ``bash benchmarks/gpu_wheels.sh``
fetches the wheels it lacks into ``benchmarks/.wheels`` (git-ignored, ~47 MB: carry that
folder to the machine); then, from the checkout there, one command installs them beside the
checkout, checks the imports, and runs every regime at batch 32 on 16 full-size scans::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site benchmarks/.wheels/*.whl \
      && export PYTHONPATH=$PWD:/tmp/site \
      && python3 -c "import zarrfeed.definitions, zarrfeed.training, monai" \
      && python3 benchmarks/gpu.py --device cuda --batch 32 > /tmp/gpu.log 2>&1; \
      grep -E "^(BENCH|#)|skipped" /tmp/gpu.log; tail -3 /tmp/gpu.log

It prints when the store is built and each regime is done (``#`` lines), so a run cut short
by a time limit says where the time went; ``--scans 8`` halves the build.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from _bench import bench
from train import QUICK_SPACING, SPACING, build_store, materialise, steady

from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.families.images import IMAGES
from zarrfeed.families.images.datasets import ImagePatchDataset
from zarrfeed.samples import make_inspection
from zarrfeed.training import TrainConfig, Trainer
from zarrfeed.training.augment import Augment
from zarrfeed.training.data.device import DevicePatches, pool_layout
from zarrfeed.training.data.epochs import Tag
from zarrfeed.training.data.feed import Feed
from zarrfeed.training.data.loader import batch_len
from zarrfeed.training.data.outofcore import MIN_SLOTS
from zarrfeed.training.runtime import amp_policy, make_optimizer
from zarrfeed.training.step import Batches, Stepped, Stepper
from zarrfeed.training.tasks import make_task

GIB = 1 << 30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def regimes(
    ds: CTPatchDataset, batch: int, device: torch.device
) -> dict[str, tuple[float, float, str]]:
    """Regime → (host cache GiB, device cache GiB, what was set).  A quarter of the dataset
    each, raised where small data would leave a pool without room for one batch (besides
    its tables, staging and gather scratch) or an arena below its minimum of units."""
    size, unit = ds.nbytes(), ds.cache.unit_bytes
    ample = (2 * size + (64 << 20)) / GIB
    bare = pool_layout(ds, 0, batch)
    smallest = bare.tables + bare.staging + bare.gather + bare.need * bare.slot_bytes
    device = max(size / 4, 1.25 * smallest)
    host = max(size / 4, (MIN_SLOTS + 4) * unit + (1 << 20), device)
    note = f"dataset {size / 1e9:.3f} GB"
    return {
        "fits": (ample, ample, f"{note}, host and device budgets {ample * GIB / 1e9:.2f} GB"),
        "device_quarter": (ample, device / GIB, f"{note}, device budget {device / size:.2f} of it"),
        "host_quarter": (
            host / GIB,
            device / GIB,
            f"{note}, host budget {host / size:.2f} and device budget {device / size:.2f} of it",
        ),
        "augmented": (ample, ample, f"{note}, as fits, the CT recipe on the device"),
    }


def configs(
    base: dict, work: Path, plan: dict[str, tuple[float, float, str]], steps: int, skip: int
) -> dict[str, TrainConfig]:
    """Regime → its training config: ``base`` with the regime's budgets, the device tier on,
    and (``augmented``) the task's augmentation recipe."""
    out = {}
    for regime, (host_gb, device_gb, _) in plan.items():
        b = base[regime] if regime in base else base["ct"]
        data = {**b["data"], "augment": {}} if regime == "augmented" else b["data"]
        cfg = TrainConfig.model_validate({**b, "data": data, "out": str(work / regime)})
        cfg.data.cache_gb = host_gb
        cfg.dataloader.device_cache, cfg.dataloader.device_cache_gb = "on", device_gb
        cfg.train.steps, cfg.train.log_every, cfg.train.checkpoint_every = steps, skip, steps
        out[regime] = cfg
    return out


def train_regime(cfg: TrainConfig, out: Path, skip: int, limit: Limit) -> Run:
    """``cfg`` trained into ``out``, against ``limit``, after ``skip`` steps.

    On a CPU the limit takes one step before each of the trainer's, in the same thread at
    the threads the trainer set (its progress hook runs there, outside the step's timing),
    so both see the same load of a shared machine, and both are rated per median step.  On
    CUDA the limit runs after the training, over its wall time (a step timed between the
    trainer's would synchronise the device and stall the trainer's queue)."""
    interleaved = limit.device.type == "cpu"
    taken: list[Stepped] = []

    def progress(step: int, steps: int) -> None:
        if interleaved and step < steps:
            taken.append(limit.step())

    with limit.feeding():
        result = Trainer(cfg.model_copy(update={"out": str(out)}), log=None, progress=progress)
        result = result.fit()
        after = None if interleaved else max(limit.rate(), limit.rate())  # the 2nd is warm
    h = result.history
    share, _, rate = steady(h, skip)
    threads = torch.get_num_threads()
    if after is not None:
        return Run(share, rate, rate, after, threads, result.loader)
    steps = [d + c for d, c in zip(h["data_time"][skip:], h["step_time"][skip:], strict=True)]
    ours = per_median_step(steps, h["samples"][skip:])
    held = per_median_step([t.data_time + t.compute for t in taken[skip:]],
                           [t.samples for t in taken[skip:]])  # fmt: skip
    return Run(share, rate, ours, held, threads, result.loader)


@dataclass(frozen=True)
class Run:
    """One training of a regime: its data-wait share, samples/s over its wall time, samples/s
    as compared with the limit (per median step on a CPU, else the same), the limit's, the
    intra-op threads and the loader's reasons."""

    share: float
    wall: float
    rate: float
    limit: float
    threads: int
    reasons: list[str]


def per_median_step(seconds: list[float], samples: list[int]) -> float:
    """Samples/s of the median step.  On a CPU every step's time is its own (the work is
    synchronous), and on a shared machine a busy neighbour stretches a few steps many times
    over (at as many intra-op threads as CPUs, one descheduled thread stalls the others):
    the median step, not the mean, is what the feed and the model cost."""
    return float(np.median(samples)) / float(np.median(seconds))


class Held:
    """One batch already on the device, handed to the trainer's step through the trainer's
    feed (its producer thread, its side stream on CUDA, its queue): augmented there with
    new parameters each step where the config augments, as the trainer's feed does."""

    def __init__(self, batch: dict, augment: Augment | None, seed: int) -> None:
        self.batch, self.augment, self.seed = batch, augment, seed

    def feed(self, device: torch.device) -> Feed:
        indices = np.arange(batch_len(self.batch))

        def produce(start: Callable[[], Tag | None]) -> Iterator[tuple[Tag, dict]]:
            if start() is None:
                return
            for step in itertools.count():  # a new epoch each step: new parameters each time
                batch = self.batch
                if self.augment is not None:
                    batch = self.augment.apply(batch, self.seed, step, indices)
                yield (step, 0), batch

        feed = Feed(produce, device, per_epoch=1)
        feed.begin(0, 0)
        return feed


class Limit:
    """The limit of a regime: the same task, model, optimiser, precision and augmentation as
    its config trains with, stepping through the trainer's own step (:class:`Stepper`) on one
    batch already on the device."""

    def __init__(self, cfg: TrainConfig, steps: int, skip: int) -> None:
        t, self.steps, self.skip = cfg.train, steps, skip
        self.device = torch.device(t.device)
        self.task = make_task(cfg)
        self.dataset = self.task.dataset("train")
        torch.manual_seed(cfg.seed)
        model = self.task.model(self.dataset).to(self.device)
        optimizer = make_optimizer(model, t.lr, t.weight_decay, self.device)  # as the trainer's
        dtype, scaled = amp_policy(t.amp, self.device)
        scaler = torch.amp.GradScaler(self.device.type, enabled=scaled)
        self.stepper = Stepper(self.task, model, model, optimizer, scaler, self.device, dtype,
                               t.accumulate, t.max_grad_norm)  # fmt: skip
        batch = DevicePatches(self.dataset, self.device).batch(
            np.arange(t.batch_size) % len(self.dataset)
        )
        augment = Augment(cfg.data.augment) if cfg.data.augment is not None else None
        self.held = Held(batch, augment, cfg.seed)
        self._feed: Feed | None = None

    @contextlib.contextmanager
    def feeding(self) -> Iterator[None]:
        """The held batch's feed open for :meth:`step` and :meth:`rate`."""
        self._feed = self.held.feed(self.device)
        try:
            yield
        finally:
            self._feed.close()
            self._feed = None

    def step(self) -> Stepped:
        """One step on the held batch (inside :meth:`feeding`)."""
        if self._feed is None:
            raise RuntimeError("Limit.step runs inside Limit.feeding()")
        return self.stepper.step(self._feed)

    def rate(self) -> float:
        """Samples/s over ``steps - skip`` steps on the held batch, after ``skip`` (inside
        :meth:`feeding`), over the wall time."""
        for _ in range(self.skip):
            self.step()
        sync(self.device)
        t0 = time.perf_counter()
        samples = sum(self.step().samples for _ in range(self.steps - self.skip))
        sync(self.device)
        return samples / (time.perf_counter() - t0)


def _rate(stepper: Stepper, batches: Batches, device: torch.device, steps: int, skip: int) -> float:
    """Samples/s over the wall time of ``steps - skip`` steps, after ``skip``."""
    for _ in range(skip):
        stepper.step(batches)
    sync(device)
    t0 = time.perf_counter()
    samples = sum(stepper.step(batches).samples for _ in range(steps - skip))
    sync(device)
    return samples / (time.perf_counter() - t0)


def monai_rate(
    ds: CTPatchDataset,
    stepper: Stepper,
    device: torch.device,
    batch: int,
    steps: int,
    skip: int,
    augment: bool = False,
) -> tuple[float | None, str]:
    """MONAI's fast-training recipe on the same volumes: the volumes cached on the device
    (``CacheDataset`` through ``ToDeviced``), random crops of the patch size there,
    ``ThreadDataLoader``; with ``augment``, the CT recipe's flips, quarter turns and affine
    as MONAI's dictionary transforms on the device tensors, one sample at a time (MONAI's
    way); None where MONAI is not installed."""
    try:
        import monai.data as md
        import monai.transforms as mt
    except ImportError:
        return None, "MONAI is not installed (pip install zarrfeed[bench])"
    labels = ds.labels if ds.labels is not None else np.zeros((len(ds.keys), 1), np.float32)
    volumes = [
        {"image": np.array(ds.array(i, ds.window))[None], "labels": torch.from_numpy(labels[i])}
        for i in range(len(ds.keys))
    ]
    per_volume = max(1, batch // len(volumes))
    transform = mt.Compose([
        mt.EnsureTyped(keys=["image", "labels"], track_meta=False),
        mt.ToDeviced(keys=["image", "labels"], device=str(device)),
        mt.RandSpatialCropSamplesd(
            keys="image", roi_size=ds.patch_shape, num_samples=per_volume, random_size=False
        ),
    ])  # fmt: skip
    if augment:  # the CT recipe's spatial operations, with its probabilities
        transform = mt.Compose([
            transform,
            *(mt.RandFlipd(keys="image", prob=0.5, spatial_axis=a) for a in range(3)),
            mt.RandRotate90d(keys="image", prob=0.5, spatial_axes=(1, 2)),
            mt.RandAffined(keys="image", prob=0.2, rotate_range=[math.radians(10)] * 3,
                           scale_range=[0.1] * 3, padding_mode="border", device=device),
            mt.RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
            mt.RandShiftIntensityd(keys="image", offsets=0.05, prob=0.5),
            mt.RandGaussianNoised(keys="image", std=0.03, prob=0.3),
        ])  # fmt: skip
    cached = md.CacheDataset(volumes, transform, cache_rate=1.0, num_workers=0, progress=False)
    loader = md.ThreadDataLoader(cached, batch_size=batch // per_volume, shuffle=True,
                                 num_workers=0, drop_last=True)  # fmt: skip

    class Batches:  # MONAI's loader, one iterator per epoch, as the trainer's step takes it
        def __init__(self) -> None:
            self.batches: Iterator[dict] = iter(())

        def next(self) -> tuple[Tag, dict]:
            found = next(self.batches, None)
            if found is None:
                self.batches = iter(loader)
                found = next(self.batches)
            return (0, 0), {"image": found["image"], "labels": found["labels"]}

    why = f"{len(volumes)} volumes cached on {device}, {per_volume} crop(s) each per batch"
    why += ", flips, quarter turns, affine, intensity and noise on the device" if augment else ""
    return _rate(stepper, Batches(), device, steps, skip), why


def build_images(work: Path, count: int) -> Path:
    """``count`` sample inspection images built through the image graph: the store."""
    raw, store = work / "raw-images", work / "images.zarr"
    list(make_inspection(raw / "inspection", count, np.random.default_rng(0)))
    materialise(IMAGES, {}, raw, store, work / "home-images")
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small data, few steps (smoke)")
    parser.add_argument("--device", default="cuda", help="cuda, cpu or auto")
    parser.add_argument("--scans", type=int, default=16, help="CT-RATE-sized scans to build")
    parser.add_argument("--images", type=int, default=32, help="inspection images to build")
    parser.add_argument("--batch", type=int, default=32, help="patches per step")
    parser.add_argument("--steps", type=int, default=400, help="training steps per regime")
    parser.add_argument("--repeat", type=int, help="runs per regime, each followed by its limit")
    parser.add_argument("--workers", default="auto", help="DataLoader workers (host path)")
    args = parser.parse_args()
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --quick)")
    scans, images, size, spacing, batch, steps, skip, repeat = (
        (4, 4, "small", QUICK_SPACING, 4, 12, 3, 3)
        if args.quick
        else (args.scans, args.images, "full", SPACING, args.batch, args.steps, 20, 1)
    )
    repeat = args.repeat or repeat
    amp = "auto" if device.type == "cuda" else "off"  # CPU: fp32, bf16 is emulated there
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["ZARRFEED_CACHE_ROOT"] = str(work / "caches")  # removed with everything else
        t0 = time.perf_counter()
        _, store = build_store(work, scans, size, spacing)
        image_store = build_images(work, images)
        scans_at = f"{scans} {size} scans at {'x'.join(f'{s:g}' for s in spacing)} mm"
        print(f"# {scans_at} and {images} inspection images built in "
              f"{time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
        common = {"resume": False, "dataloader": {"workers": args.workers},
                  "data": {"eval_batches": 1},
                  "train": {"batch_size": batch, "amp": amp, "device": str(device)}}  # fmt: skip
        base = {
            "ct": {**common, "task": "ct_classifier", "store": str(store)},
            "images": {**common, "task": "defect_segmentation", "store": str(image_store)},
        }
        cfg = TrainConfig.model_validate({**base["ct"], "out": str(work / "limit")})
        ct_ds = CTPatchDataset(store, cfg.data.window)
        plan = regimes(ct_ds, batch, device)
        patches = ImagePatchDataset(image_store)
        ample = (2 * patches.nbytes() + (64 << 20)) / GIB
        drawn = f"{len(patches)} patches of {patches.nbytes() / 1e9:.3f} GB, defects drawn"
        plan["images"] = (ample, ample, f"{drawn} on the device")
        patch_shape = "x".join(map(str, ct_ds.patch_shape))
        where = (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"{os.cpu_count()} CPU cores"
        )
        settings = {
            "ct": f"CT classifier, {batch}x1x{patch_shape} batches, {scans_at}",
            "images": f"defect segmentation, {batch}x3x{'x'.join(map(str, patches.patch_shape))}"
            f" patches, {images} inspection images",
        }
        ct_ds.close()
        patches.close()
        rates, walls, shares, notes, limits, fits = {}, {}, {}, {}, {}, None
        for regime, cfg in configs(base, work, plan, steps, skip).items():
            held = cfg.model_copy(deep=True)  # its volumes read once, through an ample cache
            held.data.cache_gb = plan["images" if regime == "images" else "fits"][0]
            limit = Limit(held, steps, skip)
            runs = [train_regime(cfg, work / regime / str(i), skip, limit) for i in range(repeat)]
            if regime == "fits":
                fits = limit  # its model steps MONAI's batches too
            else:
                limit.dataset.close()
            run, best = max(runs, key=lambda r: r.rate), max(r.limit for r in runs)
            rates[regime], walls[regime], shares[regime] = run.rate, run.wall, run.share
            limits[regime], threads, reasons = best, run.threads, run.reasons
            print(f"# {regime}: {run.rate:.0f} samples/s, waiting {run.share:.1%}, limit "
                  f"{best:.0f} samples/s; runs (samples/s, wait, limit): "
                  + ", ".join(f"({r.rate:.0f}, {r.share:.1%}, {r.limit:.0f})" for r in runs)
                  + f" ({time.perf_counter() - t0:.0f}s so far)", flush=True)  # fmt: skip
            tier = next((r for r in reasons if r.startswith("device cache")), "?")
            family = "images" if regime == "images" else "ct"
            notes[regime] = (f"{plan[regime][2]}; {tier}; {threads} intra-op threads; "
                             f"{settings[family]}, amp {amp}, {where}")  # fmt: skip
        bench("gpu.limit_samples_per_s", max(limits[r] for r in limits if r != "images"),
              "samples/s", f"one batch already on {device}; {settings['ct']}, amp {amp}, "
              f"{where}")  # fmt: skip
        how = (
            "per median step, a limit step before each of the trainer's, at its threads"
            if device.type == "cpu"
            else "over the wall time, the limit right after each run"
        )
        for regime, rate in rates.items():
            bench(f"gpu.wait_share.{regime}", shares[regime], "share", notes[regime])
            bench(f"gpu.samples_vs_limit.{regime}", rate / limits[regime], "x",
                  f"{rate:.0f} vs {limits[regime]:.0f} samples/s, {how}, best of {repeat} "
                  "run(s) each; the limit through the trainer's step and feed")  # fmt: skip
        for regime, name in (("fits", "gpu.vs_monai"), ("augmented", "gpu.vs_monai.augmented")):
            augment = regime == "augmented"
            theirs, why = monai_rate(fits.dataset, fits.stepper, device, batch, steps, skip,
                                     augment)  # fmt: skip
            if theirs is None:
                print(f"# {name} skipped: {why}")
                continue
            ours = walls[regime]
            bench(name, ours / theirs, "x",
                  f"zarrfeed {ours:.0f} vs MONAI {theirs:.0f} samples/s ({why})")  # fmt: skip
        fits.dataset.close()  # its lease renewal must not outlive the folder


if __name__ == "__main__":
    main()
