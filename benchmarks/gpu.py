"""GPU feed benchmark: how close each data regime comes to the GPU's own limit.

The CT classifier at batch 32 of 64³ patches on CT-RATE-sized scans built through the CT
graph, trained by the real trainer, in three regimes:

* ``fits`` — the volumes fit the device budget: held on the device, cut there;
* ``device_quarter`` — the device budget is a quarter of the dataset: a pool of cache-unit
  slots on the device, fed from the host cache in RAM;
* ``host_quarter`` — the host cache budget is a quarter of the dataset too: the same pool,
  fed from the out-of-core arena;
* ``augmented`` — as ``fits``, with the CT task's default augmentation on (``data.augment``:
  flips, quarter turns, a small affine, intensity and noise), batched on the device after the
  gather; its limit applies the same augmentation to the held batch each step.

For each it prints ``gpu.wait_share.<regime>`` (share of the steady steps' wall time spent
waiting for data) and ``gpu.samples_vs_limit.<regime>``: samples/s over the limit, the same
model stepping on one batch already on the device, measured in the same run.  Then
``gpu.vs_monai``: zarrfeed's ``fits`` regime against MONAI's fast-training recipe
(``CacheDataset`` + ``ToDeviced`` + ``ThreadDataLoader``, random crops of the same patch size)
on the same volumes and model, and ``gpu.vs_monai.augmented``: the same with MONAI's
``RandFlipd``, ``RandRotate90d`` and ``RandAffined`` on the device tensors after the crop.

    python benchmarks/gpu.py --device cuda            # 16 full-size scans, batch 32, 400 steps
    python benchmarks/gpu.py --device cpu --quick     # the same code paths on small data (CI):
                                                      # 4 small scans at 2x1x1 mm, batch 4, 8 steps

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

import argparse
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from _bench import bench
from train import QUICK_SPACING, SPACING, build_store, steady

from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.families.ct.tasks import ClassifierData, CTClassification
from zarrfeed.training import TrainConfig, Trainer
from zarrfeed.training.augment import Augment, AugmentConfig
from zarrfeed.training.data.device import DevicePatches, pool_layout
from zarrfeed.training.data.reader import MIN_SLOTS
from zarrfeed.training.trainer import amp_policy, make_optimizer

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


def train_regime(
    base: dict, out: Path, host_gb: float, device_gb: float, steps: int, skip: int, augment: bool
):
    """(data-wait share, samples/s) after ``skip`` steps, and the loader's reasons."""
    data = {**base["data"], "augment": {}} if augment else base["data"]  # the task's recipe
    cfg = TrainConfig.model_validate({**base, "data": data, "out": str(out)})
    cfg.data.cache_gb = host_gb
    cfg.dataloader.device_cache, cfg.dataloader.device_cache_gb = "on", device_gb
    cfg.train.steps, cfg.train.log_every, cfg.train.checkpoint_every = steps, skip, steps
    result = Trainer(cfg, log=None).fit()
    share, _, rate = steady(result.history, skip)
    return share, rate, result.loader


def limit(cfg: TrainConfig, ds: CTPatchDataset, device: torch.device, steps: int, skip: int):
    """The same model's training step, and a measurement of its samples/s on one batch that
    is already on the device (the limit)."""
    task = CTClassification(cfg)
    torch.manual_seed(cfg.seed)
    model = task.model(ds).to(device)
    t = cfg.train
    optimizer = make_optimizer(model, t.lr, t.weight_decay, device)  # as the trainer's
    dtype, scaled = amp_policy(t.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=scaled)
    held = DevicePatches(ds, device)
    batch = held.batch(np.arange(t.batch_size) % len(ds))

    def step(batch: dict) -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, _ = task.loss(model, batch)
        scaler.scale(loss).backward()
        if t.max_grad_norm > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    augment = Augment(AugmentConfig.model_validate({"recipe": ClassifierData.augment_recipe}))
    seen = iter(range(1 << 62))  # a new epoch each step: every step draws new parameters

    def augmented() -> dict:
        return augment.apply(batch, cfg.seed, next(seen), np.arange(t.batch_size))

    return step, {
        False: lambda: _rate(lambda: batch, step, device, steps, skip, t.batch_size),
        True: lambda: _rate(augmented, step, device, steps, skip, t.batch_size),
    }


def limit_as_trained(measure: Callable[[], float], reasons: list[str]) -> tuple[float, int]:
    """(the limit's samples/s, intra-op threads) with torch's intra-op threads as the
    trainer ran with them (its loader's reasons say; on a CPU the setting alone moves the
    step time several times over on a busy machine), measured right after the trainer so
    that both see the same machine."""
    found = next((m for r in reasons if (m := re.search(r"intra-op threads: (\d+)", r))), None)
    if found is not None:
        torch.set_num_threads(int(found[1]))
    threads = torch.get_num_threads()
    return max(measure(), measure()), threads  # the second skips one-off allocation


def _rate(next_batch, step, device: torch.device, steps: int, skip: int, per: int) -> float:
    for _ in range(skip):
        step(next_batch())
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps - skip):
        step(next_batch())
    sync(device)
    return (steps - skip) * per / (time.perf_counter() - t0)


def monai_rate(
    ds: CTPatchDataset,
    step,
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
    batches = iter(())

    def next_batch() -> dict:
        nonlocal batches
        found = next(batches, None)
        if found is None:
            batches = iter(loader)
            found = next(batches)
        return {"image": found["image"], "labels": found["labels"]}

    why = f"{len(volumes)} volumes cached on {device}, {per_volume} crop(s) each per batch"
    why += ", flips, quarter turns, affine, intensity and noise on the device" if augment else ""
    return _rate(next_batch, step, device, steps, skip, batch // per_volume * per_volume), why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small data, few steps (smoke)")
    parser.add_argument("--device", default="cuda", help="cuda, cpu or auto")
    parser.add_argument("--scans", type=int, default=16, help="CT-RATE-sized scans to build")
    parser.add_argument("--batch", type=int, default=32, help="patches per step")
    parser.add_argument("--steps", type=int, default=400, help="training steps per regime")
    parser.add_argument("--workers", default="auto", help="DataLoader workers (host path)")
    args = parser.parse_args()
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --quick)")
    scans, size, spacing, batch, steps, skip = (
        (4, "small", QUICK_SPACING, 4, 8, 2)
        if args.quick
        else (args.scans, "full", SPACING, args.batch, args.steps, 20)
    )
    amp = "auto" if device.type == "cuda" else "off"  # CPU: fp32, bf16 is emulated there
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["ZARRFEED_CACHE_ROOT"] = str(work / "caches")  # removed with everything else
        t0 = time.perf_counter()
        _, store = build_store(work, scans, size, spacing)
        scans_at = f"{scans} {size} scans at {'x'.join(f'{s:g}' for s in spacing)} mm"
        print(f"# {scans_at} built in {time.perf_counter() - t0:.0f}s", flush=True)
        base = {"task": "ct_classifier", "store": str(store), "resume": False,
                "dataloader": {"workers": args.workers}, "data": {"eval_batches": 1},
                "train": {"batch_size": batch, "amp": amp, "device": str(device)}}  # fmt: skip
        cfg = TrainConfig.model_validate({**base, "out": str(work / "limit")})
        plan = regimes(CTPatchDataset(store, cfg.data.window), batch, device)
        ds = CTPatchDataset(store, cfg.data.window, cache_gb=plan["fits"][0])
        step, measure = limit(cfg, ds, device, steps, skip)
        where = (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"{os.cpu_count()} CPU cores"
        )
        patch = "x".join(map(str, ds.patch_shape))
        setting = f"CT classifier, {batch}x1x{patch} batches, {scans_at}, amp {amp}, {where}"
        rates, shares, notes, limits = {}, {}, {}, {}
        for regime, (host_gb, device_gb, what) in plan.items():
            augment = regime == "augmented"
            share, rate, reasons = train_regime(
                base, work / regime, host_gb, device_gb, steps, skip, augment
            )
            rates[regime], shares[regime] = rate, share
            limits[regime], threads = limit_as_trained(measure[augment], reasons)
            print(f"# {regime}: {rate:.0f} samples/s, waiting {share:.1%} "
                  f"({time.perf_counter() - t0:.0f}s so far)", flush=True)  # fmt: skip
            tier = next((r for r in reasons if r.startswith("device cache")), "?")
            notes[regime] = f"{what}; {tier}; {threads} intra-op threads"
        bench("gpu.limit_samples_per_s", max(limits.values()), "samples/s",
              f"one batch already on {device}; {setting}")  # fmt: skip
        for regime, rate in rates.items():
            bench(f"gpu.wait_share.{regime}", shares[regime], "share",
                  f"{notes[regime]}; {setting}")  # fmt: skip
            bench(f"gpu.samples_vs_limit.{regime}", rate / limits[regime], "x",
                  f"{rate:.0f} vs {limits[regime]:.0f} samples/s, the limit at the "
                  "trainer's threads, measured right after it")  # fmt: skip
        for regime, name in (("fits", "gpu.vs_monai"), ("augmented", "gpu.vs_monai.augmented")):
            augment = regime == "augmented"
            theirs, why = monai_rate(ds, step, device, batch, steps, skip, augment)
            if theirs is None:
                print(f"# {name} skipped: {why}")
                continue
            ours = rates[regime]
            bench(name, ours / theirs, "x",
                  f"zarrfeed {ours:.0f} vs MONAI {theirs:.0f} samples/s ({why})")  # fmt: skip


if __name__ == "__main__":
    main()
