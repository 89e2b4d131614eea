"""The CT family's training tasks: CT-RATE classification and the sparse autoencoder,
each with its own ``data`` section of the training config."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from zarrfeed.errors import StoreError
from zarrfeed.families.ct.family import CT, LABELS, RECIPE
from zarrfeed.training.config import DataSection
from zarrfeed.training.metrics import auroc
from zarrfeed.training.tasks import Batch, PerClass, Task

# torch, the datasets and the models load when a task first builds or computes, not at
# import (see zarrfeed.training.tasks).
if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from zarrfeed.families.ct.datasets import CTPatchDataset, SparsePointsDataset


class WindowData(DataSection):
    """Which CT window the task reads."""

    window: str = Field("lung", description="CT window")


class ClassifierData(WindowData):
    """What the CT classifier reads: windowed patches or volumes, and which scans it holds
    out."""

    patch: bool = Field(True, description="CT patches from the patch index, else whole volumes")
    patch_sampler: Literal["stored", "uniform", "foreground"] = Field(
        "stored",
        description="where CT patches are cut in their volume: the stored patch index "
        "(mostly body), anywhere (uniform), or centred on the stored occupancy of the window "
        "(foreground)",
    )
    holdout: Literal["auto", "none"] = Field(
        "auto",
        description="evaluation samples: auto scores scans it never trains on (CT-RATE's "
        "valid_ scans, else a fixed quarter of the keys); none scores training samples (a "
        "store too small to hold any out)",
    )
    augment_recipe: ClassVar[str | None] = RECIPE


class SparseData(WindowData):
    """What the sparse autoencoder reads: a window's sparse indices.  Its batches are point
    sets (``coords``, ``counts``), not dense ``(N, C, *spatial)`` tensors, so it takes no
    ``augment``: a flip or an affine of the occupancy grid would have to move the points
    themselves, which the augmentation engine does not do."""

    augment_recipe: ClassVar[str | None] = None

    max_points: int = Field(
        1 << 20, description="points per scan before rebuilding the occupancy grid"
    )


class CTClassification(Task):
    """CT-RATE multi-label classification (18 findings) on windowed patches or volumes."""

    # The field reads per-finding AUROC (macro mean over findings with both classes among
    # the held-out scans), not accuracy: with 18 rare findings, predicting "absent"
    # everywhere is ~90 % accurate.
    name, family, metric, label, chance = "ct_classifier", CT, "auroc_mean", "AUROC", 0.5
    evaluates_on = "held_out"
    Data = ClassifierData
    classes = "finding"

    def dataset(self, split: str | None = None) -> CTPatchDataset:
        from zarrfeed.families.ct.datasets import CTPatchDataset

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
        from zarrfeed.families.ct.models import CTClassifier

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
    Data = SparseData

    def dataset(self, split: str | None = None) -> SparsePointsDataset:
        from zarrfeed.families.ct.datasets import SparsePointsDataset

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
        from zarrfeed.families.ct.datasets import collate_points

        return collate_points

    def model(self, dataset: Dataset) -> nn.Module:
        from zarrfeed.families.ct.models import OccupancyAutoencoder

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
