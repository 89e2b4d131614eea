"""The training device as a cache tier, in every regime, for any dataset that names its
batches' boxes (:class:`~zarrfeed.training.data.protocols.DeviceCuttable`).

Measured on an H200 with the CT classifier at 32 patches of 64³ per step: the cached
DataLoader delivers ~2,100 patches/s whatever its worker count and the GPU waits for data
44–57 % of each step, because the host copies every patch three times (crop, shared-memory
hand-off, pinned buffer) before the transfer.  Held on the device, a batch is one gather
per array:

* :class:`DevicePatches` — the dataset fits the device budget: every array its batches cut
  from lives on the device, one partition after another in one flat tensor;
* :class:`DeviceSlots` — it does not: a fixed pool of equal device slots holds cache units
  (the host cache's units, :mod:`~zarrfeed.training.data.units`), uploaded from the host
  cache — in RAM or the out-of-core arena alike — through pinned memory by asynchronous
  copies, evicting the least recently used units; its budget holds its lookup tables,
  staging buffers and gather scratch as well (:func:`pool_layout`).  With the block sampler
  a block's units stay resident while it is read, and the next block's go up a few per
  batch meanwhile, into room that neither block needs.

Either way the dataset says, per batch, which boxes of which cached arrays its samples read
this epoch and what small host arrays go with them; the boxes' elements are found by index
arithmetic on the device and cut by one ``torch.take`` per array, never a Python loop of
slices; the dataset's ``device_finish`` turns them into the batch, which equals what its
DataLoader path yields for the same indices.  The loading plan
(:func:`~zarrfeed.training.data.plan.plan_loading`) picks the regime from the measured sizes
and says why.
"""

from __future__ import annotations

from typing import Any

import torch

from zarrfeed.training.data.device.pool import (
    GATHER_BYTES_PER_VOXEL,
    PoolFacts,
    PoolLayout,
    augment_scratch,
    layout_pool,
    pool_facts,
    pool_layout,
)
from zarrfeed.training.data.device.slots import DeviceSlots
from zarrfeed.training.data.device.volumes import DevicePatches

__all__ = [
    "GATHER_BYTES_PER_VOXEL",
    "DevicePatches",
    "DeviceSlots",
    "PoolFacts",
    "PoolLayout",
    "augment_scratch",
    "device_source",
    "layout_pool",
    "pool_facts",
    "pool_layout",
]


def device_source(
    dataset: Any, device: torch.device, tier: str, budget_bytes: int, batch_size: int
) -> DevicePatches | DeviceSlots:
    """The device tier the loading plan chose, built (arrays uploaded; the slot pool
    allocated)."""
    if tier == "volumes":
        return DevicePatches(dataset, device)
    if tier == "slots":
        return DeviceSlots(dataset, device, budget_bytes, batch_size)
    raise ValueError(f"no device tier {tier!r} to build")
