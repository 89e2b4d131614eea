"""Training benchmark: the share of step time spent waiting for data, zarrfeed's loader vs the
naive one the seeds started from (per-sample NIfTI read + full-volume float64 preprocessing in
``__getitem__``), on the CT classification task with the same model, batches and patches.

    python benchmarks/train.py            # 4 sample scans, 40x96x96 at 5x3.6x3.6 mm, resampled
                                          # to 1.5x0.75x0.75 mm
    python benchmarks/train.py --quick    # 2 of them resampled to 2x1x1 mm (0.42 of the voxels
                                          # per naive sample), fewer steps (CI smoke run)
    python benchmarks/train.py --device cuda --batch 16 --workers auto   # on a GPU machine

On CUDA it also reports the GPU utilisation NVML sampled during each run
(a naive loader kept one team's GPU at 2.2 %).
"""

import argparse
import os
import re
import tempfile
import warnings
from pathlib import Path

import dagster as dg
import numpy as np
import torch
from _bench import GpuUtilisation, bench
from torch.utils.data import Dataset, default_collate

from zarrfeed.assets import family_assets
from zarrfeed.assets.datasets import dataset_asset
from zarrfeed.families.ct import CT
from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.families.ct.tables import read_ct_rate_metadata
from zarrfeed.families.ct.tasks import CTClassification
from zarrfeed.families.family import Family
from zarrfeed.jobs.discovery import discover_into
from zarrfeed.resources import (
    BuildOptions,
    HuggingFaceResource,
    RawFolderResource,
    ZarrStoreResource,
)
from zarrfeed.samples import make_ct_rate
from zarrfeed.training import TrainConfig, Trainer
from zarrfeed.transforms import ct
from zarrfeed.transforms.hu import csv_rescale

warnings.filterwarnings("ignore", category=dg.BetaWarning)
SPACING = (1.5, 0.75, 0.75)  # the CT settings' default (CT-CLIP)
QUICK_SPACING = (2.0, 1.0, 1.0)  # --quick: a naive sample costs 0.3 s, not 1.1-1.7 s


class NaiveCTPatches(Dataset):
    """What the seeds began with: every sample re-reads its NIfTI and preprocesses the whole
    volume (float64, ``scipy.ndimage.zoom``) before cutting the patch out of it."""

    def __init__(
        self,
        ours: CTPatchDataset,
        files: list[Path],
        rescale: list[tuple],
        spacing: tuple[float, float, float],
    ) -> None:
        self.items, self.origins, self.patch = ours.items, ours.origins, ours.patch_shape
        self.labels, self.files, self.rescale = ours.labels, files, rescale
        self.spacing = spacing  # the store's, so that the patch origins cut the same patches
        self.label_names, self.store, self.dataset = ours.label_names, ours.store, ours.dataset
        self.ours, self.keys, self.dataset_version = ours, ours.keys, ours.dataset_version

    def close(self) -> None:
        """Release the store dataset it takes its index from (and that one's lease)."""
        self.ours.close()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        import nibabel as nib
        from scipy.ndimage import zoom

        item = int(self.items[i])
        img = nib.load(self.files[item])
        vol = np.asarray(img.dataobj).astype(np.float64).transpose(2, 1, 0)
        slope, intercept = self.rescale[item]
        if vol.min() > -500:
            vol = vol * slope + intercept
        sx, sy, sz = img.header.get_zooms()[:3]
        hu = np.clip(zoom(vol, [s / t for s, t in zip((sz, sy, sx), self.spacing, strict=True)],
                          order=1), -1024, 3071)  # fmt: skip
        w = ct.get_window("lung")
        win = np.clip((hu - w.lo) / (w.hi - w.lo), 0, 1)
        (z, y, x), (d, h, ww) = (int(o) for o in self.origins[i]), self.patch
        patch = win[z : z + d, y : y + h, x : x + ww].astype(np.float16)
        return {"image": torch.from_numpy(patch)[None], "item": item,
                "labels": torch.from_numpy(self.labels[item])}  # fmt: skip


class NaiveTask(CTClassification):
    """The CT task, model and loss unchanged; only the dataset is the naive one."""

    def __init__(self, config: TrainConfig, raw: Path, spacing: tuple[float, float, float]) -> None:
        super().__init__(config)
        self.raw, self.spacing = raw, spacing

    def dataset(self, split: str | None = None) -> Dataset:
        ours = super().dataset(split)
        found = {p.name.removesuffix(".nii.gz"): p for p in self.raw.rglob("*.nii.gz")}
        meta = read_ct_rate_metadata(self.raw)
        files = [found[k] for k in ours.keys]
        claims = [csv_rescale(meta.get(k)) for k in ours.keys]
        rescale = [(c.slope, c.intercept) if c else (1.0, 0.0) for c in claims]
        return NaiveCTPatches(ours, files, rescale, self.spacing)

    def collate(self, dataset: Dataset):
        return default_collate


def build_store(
    work: Path, scans: int, size: str = "small", spacing: tuple[float, float, float] = SPACING
) -> tuple[Path, Path]:
    """``scans`` sample CT-RATE scans (``size``: "small" or "full") built through the CT
    graph into a store, resampled to ``spacing`` (z, y, x mm): (raw folder, store)."""
    raw, store = work / "raw", work / "store.zarr"
    list(make_ct_rate(raw / "ct-rate", scans, size, np.random.default_rng(0)))
    settings = {"windows": ["lung"], "spacing_zyx_mm": list(spacing)}
    materialise(CT, settings, raw, store, work / "home")
    return raw, store


def materialise(family: Family, settings: dict, raw: Path, store: Path, home: Path) -> None:
    """Every item ``family`` discovers in ``raw`` built through its graph with ``settings``
    into ``store``, then its dataset (a Dagster instance of its own in ``home``)."""
    resources = {
        "build": BuildOptions(),
        "hf": HuggingFaceResource(),
        "zarr_store": ZarrStoreResource(url=str(store)),
        "raw": RawFolderResource(root=str(raw)),
    }
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        keys = discover_into(instance, family, resources["raw"], resources["zarr_store"])
        assets = family_assets(family, settings)
        for key in keys:
            assert dg.materialize(assets, partition_key=key, resources=resources,
                                  instance=instance).success  # fmt: skip
        dataset = [dataset_asset(family)]
        assert dg.materialize(dataset, resources=resources, instance=instance).success


def steady(history: dict, skip: int) -> tuple[float, float, float]:
    """(data-wait share, seconds per step, samples/s) after ``skip`` warm-up steps."""
    wait, step = sum(history["data_time"][skip:]), sum(history["step_time"][skip:])
    n = len(history["loss"]) - skip
    return wait / (wait + step), (wait + step) / n, sum(history["samples"][skip:]) / (wait + step)


def run(
    cfg: TrainConfig, task: CTClassification | None, skip: int
) -> tuple[tuple, float | None, int]:
    """Train; (steady figures after ``skip`` steps, mean GPU utilisation over those steps,
    batches the loader holds in flight: workers x prefetch)."""
    gpu, in_flight = GpuUtilisation(), [0]

    def log(line: str) -> None:
        if found := re.search(r"num_workers=(\d+) prefetch_factor=(\d+)", line):
            in_flight[0] = int(found[1]) * int(found[2])
        if f"] step {skip} |" in line:
            gpu.start()

    cfg.train.log_every = 1
    history = Trainer(cfg, log=log, task=task).fit().history
    gpu.stop()
    return steady(history, skip), gpu.mean, in_flight[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--batch", type=int, default=4, help="patches per step")
    parser.add_argument("--workers", default="2", help="DataLoader workers: N, auto, cpu*0.9")
    parser.add_argument("--steps", type=int, default=60, help="zarrfeed training steps")
    parser.add_argument("--no-naive", action="store_true", help="zarrfeed's figures only")
    parser.add_argument("--device-cache", default="off", choices=["auto", "on", "off"])
    args = parser.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    steps, skip, measured = (8, 2, 2) if args.quick else (args.steps, 3, 8)
    scans, spacing = (2, QUICK_SPACING) if args.quick else (4, SPACING)
    amp = "auto" if cuda else "off"  # CPU: fp32, as bf16 is emulated on this machine
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["ZARRFEED_CACHE_ROOT"] = str(work / "caches")  # removed with everything else
        raw, store = build_store(work, scans, spacing=spacing)
        base = {"task": "ct_classifier", "store": str(store), "resume": False,
                "dataloader": {"workers": args.workers, "device_cache": args.device_cache},
                "data": {"eval_batches": 1},
                "train": {"batch_size": args.batch, "amp": amp,
                          "device": "cuda" if cuda else "cpu"}}  # fmt: skip
        cfg = TrainConfig.model_validate({**base, "out": str(work / "zarrfeed")})
        cfg.train.steps = steps
        ours, busy, in_flight = run(cfg, None, skip)
        naive = None
        if not args.no_naive:
            # The naive loader's first batches were prefetched while the model started:
            # measure it only once the batches in flight at the start are used up.
            naive_skip = max(skip, in_flight + 1)
            cfg = TrainConfig.model_validate({**base, "out": str(work / "naive")})
            cfg.train.steps = naive_skip + measured
            naive = run(cfg, NaiveTask(cfg, raw, spacing), naive_skip)
    (share, per_step, rate) = ours
    where = f"{torch.cuda.get_device_name()}, amp {amp}" if cuda else f"{os.cpu_count()} CPU cores"
    setting = (
        f"CT classifier, {args.batch}x1x64^3 batches, {scans} scans at "
        f"{'x'.join(f'{s:g}' for s in spacing)} mm, workers {args.workers}, "
        f"device cache {args.device_cache}, {where}, after warm-up"
    )
    bench("train.data_wait_share", share, "share", f"zarrfeed cached loader; {setting}")
    bench("train.samples_per_s", rate, "samples/s", f"zarrfeed, {per_step * 1e3:.1f} ms/step")
    if busy is not None:
        bench("train.gpu_utilisation", busy, "share", "NVML mean over the measured steps")
    if naive is None:
        return
    (nshare, nper_step, nrate), naive_busy, _ = naive
    bench("train.data_wait_share_naive", nshare, "share",
          f"per-sample NIfTI read + float64 zoom in __getitem__; {setting}")  # fmt: skip
    bench(
        "train.step_time_vs_naive",
        nper_step / per_step,
        "x",
        f"zarrfeed={per_step:.3f}s naive={nper_step:.3f}s per step (data wait + compute); "
        f"naive {nrate:.1f} samples/s",
    )
    if naive_busy is not None:
        bench("train.gpu_utilisation_naive", naive_busy, "share", "NVML, naive loader")


if __name__ == "__main__":
    main()
