"""The training data path: cached Zarr Datasets and self-sizing DataLoaders (no Dagster)."""

from zarrfeed.training.cache import SharedArrayCache
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

__all__ = [
    "CTPatchDataset",
    "ImagePatchDataset",
    "LoaderPlan",
    "SharedArrayCache",
    "SparsePointsDataset",
    "SpikeClipDataset",
    "autotune",
    "collate_batch",
    "collate_points",
    "make_loader",
    "measure",
    "plan_loader",
    "recommend",
]
