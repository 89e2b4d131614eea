"""Feeding training: the Dataset base over the committed stores, the shared decoded-data cache
(whole arrays in RAM, or chunks in a fixed arena out of core), samplers and self-sizing
loaders.  Each family's Datasets live in its package (``zarrfeed.families.<family>.datasets``)."""

from zarrfeed.training.data.arrays import Fill, SharedArrayCache
from zarrfeed.training.data.base import GB, StoreDataset, collate_batch
from zarrfeed.training.data.loader import make_loader
from zarrfeed.training.data.patches import (
    ForegroundPatches,
    PatchSampler,
    StoredPatches,
    UniformPatches,
)
from zarrfeed.training.data.plan import LoaderPlan, LoadingPlan, plan_loader, plan_loading
from zarrfeed.training.data.reader import CachedArrays
from zarrfeed.training.data.regimes import cached_arrays
from zarrfeed.training.data.sampler import BlockSampler, ResumableSampler, make_sampler
from zarrfeed.training.data.tuning import autotune, measure, recommend

__all__ = [
    "GB",
    "BlockSampler",
    "CachedArrays",
    "Fill",
    "ForegroundPatches",
    "LoaderPlan",
    "LoadingPlan",
    "PatchSampler",
    "ResumableSampler",
    "SharedArrayCache",
    "StoreDataset",
    "StoredPatches",
    "UniformPatches",
    "autotune",
    "cached_arrays",
    "collate_batch",
    "make_loader",
    "make_sampler",
    "measure",
    "plan_loader",
    "plan_loading",
    "recommend",
]
