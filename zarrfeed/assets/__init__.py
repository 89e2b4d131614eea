"""Dagster assets: orchestration only; the work is in transforms, formats and store."""

from zarrfeed.assets.ct import ct_derived, ct_hu, ct_raw_scan
from zarrfeed.assets.datasets import ct_dataset, image_dataset, spike_dataset
from zarrfeed.assets.hub import hub_ct_catalog, hub_ct_volume
from zarrfeed.assets.images import image_patches, image_raw_set, image_store
from zarrfeed.assets.spike import spike_frames, spike_raw_sequence, spike_voxels
from zarrfeed.assets.training import model_assets

ct_assets = [ct_raw_scan, ct_hu, ct_derived]
spike_assets = [spike_raw_sequence, spike_voxels, spike_frames]
image_assets = [image_raw_set, image_store, image_patches]
dataset_assets = [ct_dataset, spike_dataset, image_dataset]
hub_assets = [hub_ct_catalog, hub_ct_volume]
all_assets = [*ct_assets, *spike_assets, *image_assets, *dataset_assets, *hub_assets, *model_assets]

__all__ = [
    "all_assets",
    "ct_assets",
    "dataset_assets",
    "hub_assets",
    "image_assets",
    "model_assets",
    "spike_assets",
]
