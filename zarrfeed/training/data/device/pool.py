"""How a device slot pool's byte budget is spent (:func:`pool_layout`), from the facts of a
dataset's cached arrays and the boxes its samples cut (:func:`pool_facts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from zarrfeed.training.data.base import StoreDataset
from zarrfeed.training.data.protocols import BoxSpec
from zarrfeed.training.data.units import ArrayGroup

STAGES = 2  # pinned staging buffers: the host fills one while the other is copied up
STAGE_BYTES = 4 << 20  # each one's size: uploads go up in pieces of this much, a few per batch
GATHER_BYTES_PER_VOXEL = 12  # the gather's int64 unit ids, then int32 slots and int64 offsets
SLOT_ALIGN = 8  # slot bytes are a multiple of this: every dtype's view of the pool lines up


@dataclass(frozen=True)
class PoolLayout:
    """How a slot pool's byte budget is spent: slots for cache units, and everything else
    the pool keeps — the unit → slot table and the arrays' unit grids on the device, a
    batch's extras, pinned staging in host memory (and its landing buffer on CUDA), and the
    scratch of one batch's gather."""

    slots: int
    slot_bytes: int
    stage_units: int  # units one staging buffer moves at once
    need: int  # units one batch may need at once
    tables: int
    staging: int
    gather: int
    augment: int = 0  # the scratch of one batch's augmentation on the device

    @property
    def slot_total(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def total(self) -> int:
        return self.slot_total + self.tables + self.staging + self.gather + self.augment

    def describe(self) -> str:
        return (
            f"{self.slots} slots of {self.slot_bytes / 1e6:.2f} MB units "
            f"({self.slot_total / 1e9:.3f} GB) + lookup tables {self.tables / 1e6:.2f} MB + "
            f"staging {self.staging / 1e6:.1f} MB + gather scratch {self.gather / 1e6:.1f} MB"
            + (f" + augment scratch {self.augment / 1e6:.1f} MB" if self.augment else "")
        )


@dataclass(frozen=True)
class PoolFacts:
    """What sizing a slot pool needs to know of a dataset (:func:`pool_facts`)."""

    slot_bytes: int  # the largest cache unit cut from, in bytes (a multiple of SLOT_ALIGN)
    units: int  # cache units in the dataset
    scans: int  # partitions of the arrays cut from, summed over those arrays
    unit_dims: int  # axes of a unit (the most of any array cut from)
    extra_bytes: int  # bytes of one sample's extras (labels, ids) sent up with its batch
    units_per_patch: int  # units one sample's boxes can overlap at most
    patch_voxels: int  # elements one sample's boxes hold at most
    uniform: bool  # every partition of an array has the same unit shape (a pool needs it)
    augment: int = 0  # device bytes the dataset's augmentation takes per batch (0: none)


def units_per_box(group: ArrayGroup, shape: tuple[int, ...]) -> int:
    """Cache units one box of ``shape`` can overlap at most: ``(p + u - 2) // u + 1`` along
    each axis, for the largest count over the array's unit shapes."""
    return max(
        int(np.prod([(p + u - 2) // u + 1 for p, u in zip(shape, unit, strict=True)]))
        for unit in {tuple(u) for u in group.units.tolist()}
    )


def sample_units(group: ArrayGroup, spec: BoxSpec) -> int:
    """Units one sample's boxes of ``spec`` can overlap: at most every unit of a partition."""
    return min(spec.count * units_per_box(group, spec.shape), int(group.counts().max()))


def pool_facts(dataset: Any, batch_size: int | None = None) -> PoolFacts:
    """The facts :func:`layout_pool` sizes a pool from, read from ``dataset``'s cache and
    its device specs (and the extras its first sample sends up); its augmentation's scratch
    for batches of ``batch_size`` (needed when it has one)."""
    specs: dict[str, BoxSpec] = dataset.device_specs()
    cache = dataset.cache
    groups = {(s.asset, s.name): cache.groups[s.asset, s.name] for s in specs.values()}
    largest = max(int(np.prod(g.units, axis=1).max()) * g.dtype.itemsize for g in groups.values())
    extras = dataset.device_cuts(np.zeros(1, np.int64)).extras if len(dataset) else {}
    per_spec = [(cache.groups[s.asset, s.name], s) for s in specs.values()]
    return PoolFacts(
        slot_bytes=-(-largest // SLOT_ALIGN) * SLOT_ALIGN,
        units=max(int(g.offsets[-1]) for g in cache.groups.values()),
        scans=sum(len(g.shapes) for g in groups.values()),
        unit_dims=max(int(g.units.shape[1]) for g in groups.values()),
        extra_bytes=sum(int(np.asarray(v).nbytes) for v in extras.values()),
        units_per_patch=sum(sample_units(g, s) for g, s in per_spec),
        patch_voxels=sum(s.count * int(np.prod(s.shape)) for s in specs.values()),
        uniform=all(len({tuple(u) for u in g.units.tolist()}) == 1 for g in groups.values()),
        augment=augment_scratch(dataset, batch_size),
    )


def augment_scratch(dataset: Any, batch_size: int | None) -> int:
    """Device bytes the dataset's augmentation allocates for one batch (0: it has none)."""
    if not isinstance(dataset, StoreDataset) or dataset.augment is None:
        return 0
    if batch_size is None:
        raise ValueError(
            f"{type(dataset).__name__} augments its batches: the batch size is needed to "
            "size the augmentation's device scratch"
        )
    return dataset.augment.batch_scratch(dataset.load(0), batch_size)


def layout_pool(facts: PoolFacts, budget_bytes: int, batch_size: int) -> PoolLayout:
    """The slot pool that ``budget_bytes`` holds at ``batch_size``, the augmentation's
    scratch left free (its ``slots`` may be fewer than a batch needs: then there is no
    pool)."""
    slot_bytes = facts.slot_bytes
    # on the device: unit -> slot (int32); per partition its first unit, grid strides, unit
    # shape and unit strides (int64); a batch's extras
    tables = (
        facts.units * 4 + facts.scans * 3 * facts.unit_dims * 8 + batch_size * facts.extra_bytes
    )
    need = batch_size * facts.units_per_patch
    stage = max(1, min(need, STAGE_BYTES // slot_bytes))
    # pinned buffers -> one landing buffer on the device -> slots; and their indices
    staging = (STAGES + 1) * stage * slot_bytes + STAGES * stage * 16
    gather = GATHER_BYTES_PER_VOXEL * batch_size * facts.patch_voxels
    augment = facts.augment
    slots = max(0, (int(budget_bytes) - tables - staging - gather - augment) // slot_bytes)
    return PoolLayout(slots, slot_bytes, stage, need, tables, staging, gather, augment)


def pool_layout(dataset: Any, budget_bytes: int, batch_size: int) -> PoolLayout:
    """The slot pool that ``budget_bytes`` holds for ``dataset`` at ``batch_size``, its
    augmentation's scratch counted."""
    return layout_pool(pool_facts(dataset, batch_size), budget_bytes, batch_size)
