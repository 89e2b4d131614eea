"""The image family's training task: defect segmentation, with its own ``data`` section
of the training config."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from zarrfeed.families.images.family import IMAGES, RECIPE
from zarrfeed.training.config import DataSection
from zarrfeed.training.tasks import Batch, Task

# torch, the datasets and the models load when a task first builds or computes.
if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from zarrfeed.families.images.datasets import ImagePatchDataset

# A defect pixel's BCE weight (defects are ~0.05 % of a patch's pixels); a pixel counts as a
# defect where the weighted model's logit exceeds log(weight), i.e. where the unweighted
# probability would pass 0.5.
DEFECT_WEIGHT = 20.0


class DefectData(DataSection):
    """What the defect segmenter reads: image patches, with or without synthesised
    defects."""

    defects: bool = Field(True, description="synthesise local defects on image patches")
    augment_recipe: ClassVar[str | None] = RECIPE


class DefectSegmentation(Task):
    """Defect segmentation on inspection-image patches: synthesised local defects that the
    inspected channel has and its references lack, against their masks."""

    name, family, metric, label = "defect_segmentation", IMAGES, "iou", "IoU"
    Data = DefectData
    # Defects cover ~0.05 % of a patch: a segmenter finds none before ~60 steps of 8 patches
    # (its IoU stays 0 at 40 steps of 4).
    defaults = {"train": {"steps": 100, "batch_size": 8, "lr": 0.003}}  # noqa: RUF012

    def dataset(self, split: str | None = None) -> ImagePatchDataset:
        from zarrfeed.families.images.datasets import ImagePatchDataset

        d = self.config.data
        return ImagePatchDataset(
            self.config.store,
            d.defects,
            cache_gb=d.cache_gb,
            seed=self.config.seed,
            dataset_version=d.dataset_version,
        )

    def model(self, dataset: Dataset) -> nn.Module:
        from zarrfeed.families.images.models import DefectSegmenter

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
