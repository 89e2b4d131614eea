"""Batched, seeded augmentation against the same operations one sample at a time, against
MONAI's dictionary transforms and against Kornia's batched augmentation, in one run.

* ``augment.batched_vs_per_sample`` — the default CT recipe on a batch of CT patches, one
  call per batch vs one call per sample (the same pipeline, the same samples);
* ``augment.vs_monai`` — flips on three axes, quarter turns, a small affine on image and
  mask: MONAI's ``RandFlipd``, ``RandRotate90d``, ``RandAffined`` on tensors on the device,
  one sample at a time and stacked, vs one batched call;
* ``augment.vs_kornia`` — flips on three axes and a small affine on the image (Kornia 0.9
  resamples no 3-D masks and has no 3-D quarter turn): ``kornia.augmentation`` batched.

    python benchmarks/augment.py [--device cuda] [--batch 32] [--edge 64] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench import bench, best_of, ratio

from zarrfeed.training.augment import Augment, AugmentConfig
from zarrfeed.transforms.augment import Affine, Flip, Pipeline, Rot90

FLIP_P, ROT90_P, AFFINE_P, DEGREES, SCALE = 0.5, 0.5, 0.2, 10.0, (0.9, 1.1)
REPEAT = 7  # best of: the least disturbed run on a shared machine


def timed(device: torch.device, fn) -> float:
    def run() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()  # warm: first-call allocations, kernel selection, MONAI/Kornia set-up
    return best_of(run, repeat=REPEAT)


def per_sample(p: Pipeline, batch: dict, indices: list[int]) -> dict:
    parts = [
        p.apply({k: v[i : i + 1] for k, v in batch.items()}, 0, 1, [j])
        for i, j in enumerate(indices)
    ]
    return {k: torch.cat([part[k] for part in parts]) for k in batch}


def batched_vs_per_sample(batch: dict, device: torch.device) -> None:
    augment = Augment(AugmentConfig(recipe="ct"))
    images = {"image": batch["image"]}
    indices = list(range(len(images["image"])))
    ours = timed(device, lambda: augment.apply(images, 0, 1, indices))
    base = timed(device, lambda: per_sample(augment.pipeline, images, indices))
    batched = augment.apply(images, 0, 1, indices)["image"].float()
    diff = (batched - per_sample(augment.pipeline, images, indices)["image"].float()).abs().max()
    ratio("augment.batched_vs_per_sample", ours, base,
          f"CT recipe, {tuple(images['image'].shape)} {images['image'].dtype} on {device}; "
          f"max diff {diff:.1e}")  # fmt: skip


def vs_monai(batch: dict, device: torch.device) -> None:
    try:
        from monai.transforms import Compose, RandAffined, RandFlipd, RandRotate90d
    except ImportError:
        print("# augment.vs_monai skipped: MONAI is not installed")
        return
    keys = ["image", "mask"]
    monai = Compose(
        [RandFlipd(keys, prob=FLIP_P, spatial_axis=a) for a in range(3)]
        + [
            RandRotate90d(keys, prob=ROT90_P, max_k=3, spatial_axes=(1, 2)),
            RandAffined(
                keys,
                prob=AFFINE_P,
                rotate_range=(math.radians(DEGREES),) * 3,
                scale_range=(SCALE[1] - 1,) * 3,
                mode=("bilinear", "nearest"),
                padding_mode="border",
                device=device,
            ),
        ]
    )
    monai.set_random_state(seed=0)
    ours = Pipeline(
        keys={"image": "image", "mask": "mask"},
        flip=Flip(p=FLIP_P, axes=(0, 1, 2)),
        rot90=Rot90(p=ROT90_P, axes=(1, 2)),
        affine=Affine(p=AFFINE_P, rotate=DEGREES, scale=SCALE),
    )
    indices = list(range(len(batch["image"])))

    def one_at_a_time() -> None:
        out = [monai({k: batch[k][i] for k in keys}) for i in indices]
        torch.stack([o["image"] for o in out]), torch.stack([o["mask"] for o in out])

    t_ours = timed(device, lambda: ours.apply(batch, 0, 1, indices))
    t_monai = timed(device, one_at_a_time)
    ratio("augment.vs_monai", t_ours, t_monai,
          f"flips x3, rot90, affine p={AFFINE_P} on image+mask {tuple(batch['image'].shape)} "
          f"on {device}: MONAI one sample at a time vs one batched call")  # fmt: skip


def vs_kornia(batch: dict, device: torch.device) -> None:
    try:
        import kornia.augmentation as K
    except ImportError:
        print("# augment.vs_kornia skipped: Kornia is not installed (the bench extra)")
        return
    kornia = K.AugmentationSequential(
        K.RandomDepthicalFlip3D(p=FLIP_P),
        K.RandomVerticalFlip3D(p=FLIP_P),
        K.RandomHorizontalFlip3D(p=FLIP_P),
        K.RandomAffine3D(degrees=DEGREES, scale=SCALE, p=AFFINE_P),
    ).to(device)
    ours = Pipeline(
        flip=Flip(p=FLIP_P, axes=(0, 1, 2)),
        affine=Affine(p=AFFINE_P, rotate=DEGREES, scale=SCALE),
        padding="zeros",
    )
    images = {"image": batch["image"].float()}
    indices = list(range(len(images["image"])))
    t_ours = timed(device, lambda: ours.apply(images, 0, 1, indices))
    t_kornia = timed(device, lambda: kornia(images["image"]))
    ratio("augment.vs_kornia", t_ours, t_kornia,
          f"flips x3, affine p={AFFINE_P} on the image {tuple(images['image'].shape)} on "
          f"{device}: both batched")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--edge", type=int, default=64, help="patch edge (a cube)")
    parser.add_argument("--quick", action="store_true", help="small batches (CI smoke)")
    args = parser.parse_args()
    device = torch.device(args.device)
    n, edge = (4, 24) if args.quick else (args.batch, args.edge)
    g = torch.Generator().manual_seed(0)
    batch = {
        "image": torch.rand((n, 1, edge, edge, edge), generator=g).to(device),
        "mask": (torch.rand((n, 1, edge, edge, edge), generator=g) > 0.7).to(device, torch.uint8),
    }
    batched_vs_per_sample(batch, device)
    vs_monai(batch, device)
    vs_kornia(batch, device)
    ct = Augment(AugmentConfig(recipe="ct"))
    bench("augment.scratch_mb",
          ct.scratch_bytes({"image": batch["image"].shape}, {"image": torch.float32})
          / 1e6, "MB", f"CT recipe on {tuple(batch['image'].shape)} float32")  # fmt: skip


if __name__ == "__main__":
    main()
