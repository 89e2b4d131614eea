"""The spike family's training task: spike-guided deblurring, with its own ``data``
section of the training config."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from zarrfeed.families.spike.family import RECIPE, SPIKE, SPIKE_VOXELS
from zarrfeed.training.config import DataSection
from zarrfeed.training.tasks import Batch, Task

# torch, the datasets and the models load when a task first builds or computes.
if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from zarrfeed.families.spike.datasets import SpikeClipDataset


class DeblurData(DataSection):
    """What the deblurring task reads: clips of samples, cropped, with their voxels."""

    clip_len: int = Field(3, description="spike clip length in samples")
    crop: list[int] = Field([64, 64], description="spike crop (H, W)", validate_default=True)
    voxels: Literal["stored", "realtime"] = Field("stored", description="spike voxel source")
    augment_recipe: ClassVar[str | None] = RECIPE

    @field_validator("crop")
    @classmethod
    def _square_for_quarter_turns(cls, crop: list[int], info: ValidationInfo) -> list[int]:
        """A quarter turn needs a square plane: with ``augment.rot90`` on, a crop that is
        not square in its axes is refused here, not at the first augmented batch.  The
        clips' spatial axes are the crop's (H, W) when ``spatial_dims`` is 2, as the recipe
        declares."""
        if len(crop) != 2:
            raise ValueError(f"expected (H, W), got {crop}")
        augment = info.data.get("augment")
        turn = augment.rot90 if augment is not None and augment.spatial_dims == 2 else None
        if turn is not None:
            turn.check_plane(tuple(crop))
        return crop


class SpikeDeblurring(Task):
    """Spike-guided deblurring: a clip's middle blurred frame + its spike voxels → the sharp
    frame."""

    name, family, metric, label = "spike_deblur", SPIKE, "psnr", "PSNR"
    Data = DeblurData

    def dataset(self, split: str | None = None) -> SpikeClipDataset:
        from zarrfeed.families.spike.datasets import SpikeClipDataset

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
        from zarrfeed.families.spike.models import SpikeDeblur

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
