"""The four training tasks: which dataset each reads, its model, its loss and metrics.

A task turns a collated batch (already on the device) into ``(loss, metrics)``; the trainer
owns everything else.  Inputs are converted to float inside the task, under autocast.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zarrfeed.errors import StoreError
from zarrfeed.families import Family
from zarrfeed.families.ct import CT, LABELS
from zarrfeed.families.images import IMAGES
from zarrfeed.families.spike import SPIKE, SPIKE_VOXELS
from zarrfeed.training.metrics import auroc

# torch, the datasets and the models load when a task first builds or computes, not at
# import: the code location's model assets and the config's validation read only the tasks'
# names, families, versions and metrics, and every run and step process loads the code
# location (torch adds ~1.1 s of CPU to each).
if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from zarrfeed.training.config import TrainConfig
    from zarrfeed.training.data import (
        CTPatchDataset,
        ImagePatchDataset,
        SparsePointsDataset,
        SpikeClipDataset,
    )

Batch = dict[str, "torch.Tensor"]
# Per-class tables of the evaluation batches: metric name -> class name -> value (None where
# the metric is undefined for that class).
PerClass = dict[str, dict[str, float | None]]
# defect_segmentation: a defect pixel's BCE weight (defects are ~0.05 % of a patch's pixels);
# a pixel counts as a defect where the weighted model's logit exceeds log(weight), i.e. where
# the unweighted probability would pass 0.5.
DEFECT_WEIGHT = 20.0
# The check every model asset carries, which the training process reports.
LEARNED = "learned"
LEARNED_DOC = (
    "On fixed evaluation batches, before and after training: the loss fell and the task's "
    "headline metric moved its way and past chance (held-out per-finding AUROC mean above "
    "0.5 for the CT classifier, IoU or PSNR for the others; a segmenter that finds nothing "
    "stays at IoU 0)."
)


class Task:
    """One task: ``dataset``, ``model`` and ``loss``; ``family`` is the family whose dataset
    manifest it reads (its model asset depends on that dataset)."""

    name: str = ""
    family: Family
    version: str = "2"  # bump when what it trains from the same data changes (2: torchrun)
    # The task's headline metric: the score the field reads for it, on the evaluation
    # batches (a key of what ``loss`` or ``pooled`` returns), which way is better, and the
    # value a model that guesses scores (None: no such floor).  The ``learned`` check and
    # the demo's summary read these and nothing else (:meth:`learned`).
    metric: str = ""
    label: str = ""  # the metric as a person reads it in a summary ("AUROC")
    higher_is_better: bool = True
    chance: float | None = None
    # Which samples the evaluation batches come from: "train" scores the training samples
    # (a task without a held-out split); "held_out" scores only samples never trained on
    # (``data.holdout`` can turn that off for a store too small to hold any out).
    evaluates_on: str = "train"
    # Config sections laid under what a run gives, where the task needs other defaults than
    # the sections' to learn anything in a default run (the sample data, a retrain started by
    # new data); values given in a file, on the command line or in run config still win.
    defaults: dict[str, dict[str, Any]] = {}  # noqa: RUF012 (read only)
    data_fields: tuple[str, ...] = ("cache_gb", "eval_batches")  # the data.* fields it reads
    classes: str = "class"  # what its per-class metrics are per (a finding, for CT-RATE)

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    @classmethod
    def summary(cls) -> str:
        """The task in one line (its docstring's first sentence)."""
        return " ".join((cls.__doc__ or cls.name).split()).split(". ")[0].rstrip(".")

    def settings(self) -> dict[str, Any]:
        """The config as this task reads it, flat (``train.lr``): the data fields of other
        tasks and where the run writes are left out."""
        own = {f"data.{name}" for name in self.data_fields}
        return {
            key: value
            for key, value in self.config.flat().items()
            if key not in ("out", "run_name", "resume", "resume_anyway")
            and (not key.startswith("data.") or key in own)
        }

    def dataset(self, split: str | None = None) -> Dataset:
        """The task's dataset: every sample (``split`` None), or only the samples it trains
        on ("train") or is evaluated on ("eval"); a task without a held-out split gives
        every sample to both."""
        raise NotImplementedError

    @classmethod
    def learned(
        cls, before: dict[str, float | None], after: dict[str, float | None]
    ) -> tuple[bool, str]:
        """Whether evaluation ``before`` -> ``after`` training shows that the model learned,
        and why in a few words: the loss fell and the headline metric moved the better way
        and ended past chance.  An undefined metric (None, or missing) has not learned."""
        m, shown = cls.metric, cls.label or cls.metric
        b, a = before.get(m), after.get(m)
        if a is None or b is None:
            return False, f"did not learn: {shown} undefined on the evaluation samples"
        if cls.chance is not None and (
            a <= cls.chance if cls.higher_is_better else a >= cls.chance
        ):
            sign = "≤" if cls.higher_is_better else "≥"
            return False, f"did not learn: {shown} {a:.2f} {sign} {cls.chance:g} (chance)"
        if not (a > b if cls.higher_is_better else a < b):
            return False, f"did not learn: {shown} {b:.2f} -> {a:.2f}"
        lb, la = before.get("loss"), after.get("loss")
        if lb is None or la is None or not la < lb:
            return False, f"did not learn: {shown} {b:.2f} -> {a:.2f}, loss did not fall"
        return True, f"{shown} {b:.2f} -> {a:.2f}"

    def model(self, dataset: Dataset) -> nn.Module:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and the task's metrics, all device tensors: reading a value back waits
        for the device, which the training loop does only at log steps."""
        raise NotImplementedError

    def collate(self, dataset: Dataset) -> Callable[[list[Any]], Any]:
        from torch.utils.data import default_collate

        return getattr(dataset, "collate", None) or default_collate

    def pooled(
        self, model: nn.Module, batches: Sequence[Batch]
    ) -> tuple[dict[str, float | None], PerClass]:
        """Metrics over all evaluation batches at once (ranks, not per-batch means), as
        scalars and per-class tables; a task without any returns none."""
        return {}, {}


class CTClassification(Task):
    """CT-RATE multi-label classification (18 findings) on windowed patches or volumes."""

    # The field reads per-finding AUROC (macro mean over findings with both classes among
    # the held-out scans), not accuracy: with 18 rare findings, predicting "absent"
    # everywhere is ~90 % accurate.
    name, family, metric, label, chance = "ct_classifier", CT, "auroc_mean", "AUROC", 0.5
    evaluates_on = "held_out"
    data_fields = ("window", "patch", "holdout", *Task.data_fields)
    classes = "finding"

    def dataset(self, split: str | None = None) -> CTPatchDataset:
        from zarrfeed.training.data import CTPatchDataset

        d = self.config.data
        ds = CTPatchDataset(
            self.config.store,
            d.window,
            d.patch,
            cache_gb=d.cache_gb,
            seed=self.config.seed,
            dataset_version=d.dataset_version,
            patch_sampler=d.patch_sampler,
            split=split if d.holdout == "auto" else None,
        )
        if ds.labels is None:
            raise StoreError(
                f"{self.name} needs CT-RATE labels: {self.config.store} has no "
                f"{CT.dataset_path}/{LABELS} table (put the multi_abnormality_labels CSV beside "
                f"the scans and rebuild {CT.dataset_asset})"
            )
        self.label_names = list(ds.label_names)
        return ds

    def model(self, dataset: Dataset) -> nn.Module:
        from zarrfeed.training.models import CTClassifier

        t = self.config.train
        return CTClassifier(len(dataset.label_names), t.width, t.grad_checkpointing)

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch
        from torch.nn import functional as F

        logits = model(batch["image"].float())
        labels = batch["labels"]
        known = ~torch.isnan(labels)  # scans without a label row do not count
        target = torch.nan_to_num(labels)
        per = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none")
        loss = (per * known).sum() / known.sum().clamp(min=1)
        correct = ((logits > 0) == (target > 0.5)) & known
        accuracy = correct.sum() / known.sum().clamp(min=1)
        return loss, {"accuracy": accuracy}

    def pooled(
        self, model: nn.Module, batches: Sequence[Batch]
    ) -> tuple[dict[str, float | None], PerClass]:
        """Per-finding AUROC over every evaluation sample (the field's usual report), the
        counts of positives and negatives behind it, and the mean over defined findings."""
        import torch

        scores = torch.cat([model(b["image"].float()).float().cpu() for b in batches]).numpy()
        labels = torch.cat([b["labels"].float().cpu() for b in batches]).numpy()
        known = ~np.isnan(labels)
        tables: PerClass = {"auroc": {}, "positives": {}, "negatives": {}}
        for i, name in enumerate(self.label_names):
            tables["auroc"][name] = auroc(labels[:, i], scores[:, i])
            tables["positives"][name] = int((labels[known[:, i], i] > 0.5).sum())
            tables["negatives"][name] = int(known[:, i].sum()) - tables["positives"][name]
        defined = [v for v in tables["auroc"].values() if v is not None]
        return {"auroc_mean": float(np.mean(defined)) if defined else None}, tables


class SparseAutoencoder(Task):
    """Occupancy grids rebuilt from the sparse indices (TRELLIS 64³), encoded and decoded."""

    name, family, metric, label = "sparse_autoencoder", CT, "iou", "IoU"
    data_fields = ("window", "max_points", *Task.data_fields)

    def dataset(self, split: str | None = None) -> SparsePointsDataset:
        from zarrfeed.training.data import SparsePointsDataset

        d = self.config.data
        ds = SparsePointsDataset(
            self.config.store,
            d.window,
            max_points=d.max_points,
            cache_gb=d.cache_gb,
            seed=self.config.seed,
            dataset_version=d.dataset_version,
        )
        grid = ds.pinned_attrs(ds.asset, [0])[0]["params"]["sparse_grid"]
        if not grid:
            raise StoreError(
                f"sparse_autoencoder needs an occupancy grid: {ds.asset} of {ds.url} was built "
                "at full resolution (set ct_settings.sparse_grid, e.g. 64)"
            )
        self.grid = int(grid)
        return ds

    def collate(self, dataset: Dataset) -> Callable[[list[Any]], Any]:
        from zarrfeed.training.data import collate_points

        return collate_points

    def model(self, dataset: Dataset) -> nn.Module:
        from zarrfeed.training.models import OccupancyAutoencoder

        t = self.config.train
        return OccupancyAutoencoder(t.width, checkpointing=t.grad_checkpointing)

    def occupancy(self, batch: Batch) -> torch.Tensor:
        import torch

        coords = batch["coords"].long()
        g = self.grid
        grid = torch.zeros((len(batch["counts"]), 1, g, g, g), device=coords.device)
        grid[coords[:, 0], 0, coords[:, 1], coords[:, 2], coords[:, 3]] = 1.0
        return grid

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from torch.nn import functional as F

        target = self.occupancy(batch)
        logits = model(target).float()
        # Occupied cells are the minority: weigh them by the empty/occupied ratio (capped).
        occupied = target.sum().clamp(min=1)
        weight = ((target.numel() - occupied) / occupied).clamp(max=20.0)
        loss = F.binary_cross_entropy_with_logits(logits, target, pos_weight=weight)
        pred = logits > 0
        union = (pred | (target > 0)).sum()
        iou = (pred & (target > 0)).sum() / union.clamp(min=1)
        return loss, {"iou": iou}


class SpikeDeblurring(Task):
    """Spike-guided deblurring: a clip's middle blurred frame + its spike voxels → the sharp
    frame."""

    name, family, metric, label = "spike_deblur", SPIKE, "psnr", "PSNR"
    data_fields = ("clip_len", "crop", "voxels", *Task.data_fields)

    def dataset(self, split: str | None = None) -> SpikeClipDataset:
        from zarrfeed.training.data import SpikeClipDataset

        d = self.config.data
        ds = SpikeClipDataset(
            self.config.store,
            d.clip_len,
            tuple(d.crop),
            d.voxels,
            cache_gb=d.cache_gb,
            seed=self.config.seed,
            dataset_version=d.dataset_version,
        )
        attrs = ds.pinned_attrs(SPIKE_VOXELS.path, [0])[0]
        frames, bins = attrs["frames"], attrs["params"]["bins"]
        self.voxel_scale = float(math.ceil(frames / bins))  # max count per bin
        return ds

    def model(self, dataset: Dataset) -> nn.Module:
        from zarrfeed.training.models import SpikeDeblur

        _, bins, _, _ = dataset.voxel_shapes[0]
        t = self.config.train
        return SpikeDeblur(3 + self.config.data.clip_len * bins, t.width, t.grad_checkpointing)

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch
        from torch.nn import functional as F

        mid = batch["blur"].shape[1] // 2
        blur = batch["blur"][:, mid].float() / 255
        sharp = batch["sharp"][:, mid].float() / 255
        voxels = batch["voxels"].flatten(1, 2).float() / self.voxel_scale
        pred = model(blur, voxels).float()
        loss = F.l1_loss(pred, sharp)
        mse = F.mse_loss(pred.detach().clamp(0, 1), sharp)
        return loss, {"psnr": 10 * torch.log10(1 / mse.clamp(min=1e-10))}


class DefectSegmentation(Task):
    """Defect segmentation on inspection-image patches: synthesised local defects that the
    inspected channel has and its references lack, against their masks."""

    name, family, metric, label = "defect_segmentation", IMAGES, "iou", "IoU"
    data_fields = ("defects", *Task.data_fields)
    # Defects cover ~0.05 % of a patch: a segmenter finds none before ~60 steps of 8 patches
    # (its IoU stays 0 at 40 steps of 4).
    defaults = {"train": {"steps": 100, "batch_size": 8, "lr": 0.003}}  # noqa: RUF012

    def dataset(self, split: str | None = None) -> ImagePatchDataset:
        from zarrfeed.training.data import ImagePatchDataset

        d = self.config.data
        return ImagePatchDataset(
            self.config.store,
            d.defects,
            cache_gb=d.cache_gb,
            seed=self.config.seed,
            dataset_version=d.dataset_version,
        )

    def model(self, dataset: Dataset) -> nn.Module:
        from zarrfeed.training.models import DefectSegmenter

        t = self.config.train
        return DefectSegmenter(3, t.width, t.grad_checkpointing)

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch
        from torch.nn import functional as F

        logits = model(batch["image"]).float()
        target = batch["mask"].float()
        prob = torch.sigmoid(logits)
        dice = 1 - (2 * (prob * target).sum() + 1) / (prob.sum() + target.sum() + 1)
        weight = torch.tensor(DEFECT_WEIGHT, device=logits.device)
        loss = F.binary_cross_entropy_with_logits(logits, target, pos_weight=weight) + dice
        pred, truth = logits > math.log(DEFECT_WEIGHT), target > 0
        iou = (pred & truth).sum() / (pred | truth).sum().clamp(min=1)
        return loss, {"iou": iou}


TASK_TYPES: dict[str, type[Task]] = {
    t.name: t for t in (CTClassification, SparseAutoencoder, SpikeDeblurring, DefectSegmentation)
}


def model_asset_name(task: str) -> str:
    """The Dagster asset of the model ``task`` trains."""
    return f"{task}_model"


def make_task(config: TrainConfig) -> Task:
    return TASK_TYPES[config.task](config)
