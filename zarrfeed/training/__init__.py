"""Training: cached Zarr Datasets, self-sizing DataLoaders and the trainer (no Dagster)."""

from zarrfeed.training.cache import Fill, SharedArrayCache
from zarrfeed.training.config import TrainConfig
from zarrfeed.training.datasets import (
    CTPatchDataset,
    ImagePatchDataset,
    SparsePointsDataset,
    SpikeClipDataset,
    collate_batch,
    collate_points,
)
from zarrfeed.training.loader import (
    LoaderPlan,
    autotune,
    make_loader,
    measure,
    plan_loader,
    recommend,
)
from zarrfeed.training.trainer import Trainer, TrainResult, train

__all__ = [
    "CTPatchDataset",
    "Fill",
    "ImagePatchDataset",
    "LoaderPlan",
    "SharedArrayCache",
    "SparsePointsDataset",
    "SpikeClipDataset",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "autotune",
    "collate_batch",
    "collate_points",
    "make_loader",
    "measure",
    "plan_loader",
    "recommend",
    "train",
]
