"""The training device as a cache tier for CT patches, in every regime.

Measured on an H200 with the CT classifier at 32 patches of 64³ per step: the cached
DataLoader delivers ~2,100 patches/s whatever its worker count and the GPU waits for data
44–57 % of each step, because the host copies every patch three times (crop, shared-memory
hand-off, pinned buffer) before the transfer.  Held on the device, a batch is one gather:

* :class:`DevicePatches` — the dataset fits the device budget: every volume lives on the
  device, one after another in one flat tensor;
* :class:`DeviceSlots` — it does not: a fixed pool of equal device slots holds cache units
  (the host cache's units, :mod:`~zarrfeed.training.data.units`), uploaded from the host
  cache — in RAM or the out-of-core arena alike — through pinned memory by asynchronous
  copies, evicting the least recently used units; its budget holds its lookup tables,
  staging buffers and gather scratch as well (:func:`pool_layout`).  With the block sampler
  a block's units stay resident while it is read, and the next block's go up a few per
  batch meanwhile, into room that neither block needs.

Either way a batch's voxels are found by index arithmetic on the device and cut by one
``torch.take``, never a Python loop of slices, and the batch equals what the dataset's own
``__getitems__`` returns for the same indices.  The loading plan
(:func:`~zarrfeed.training.data.plan.plan_loading`) picks the regime from the measured sizes
and says why.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zarrfeed.training.data.ct import CTPatchDataset
from zarrfeed.training.data.reader import copy_threads

_TORCH = {"f2": torch.float16, "f4": torch.float32, "u1": torch.uint8, "i2": torch.int16}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return _TORCH[np.dtype(dtype).str[1:]]


def _pinned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host staging: pinned when it feeds a CUDA device (the copy is then asynchronous, and
    torch's pinned allocator keeps the block until that copy has finished)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host table on ``device``, through pinned memory on CUDA (the host never
    waits for the copy: it is ordered on the current stream before what reads it)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host.to(device, copy=True)
    staged = _pinned(tuple(host.shape), host.dtype, device)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)


class _PatchSource:
    """What both tiers share: the patch index and labels, and the batch around the image."""

    def __init__(self, dataset: CTPatchDataset, device: torch.device) -> None:
        if not (isinstance(dataset, CTPatchDataset) and dataset.patch):
            raise ValueError("the device cache cuts CT patches: a CTPatchDataset with patch=True")
        self.dataset, self.device = dataset, device
        self.group = dataset.cache.groups[dataset.asset, dataset.window]
        self.dtype = _torch_dtype(self.group.dtype)
        labels = dataset.labels
        self.labels = None if labels is None else _to_device(labels, device)
        self._steps = [torch.arange(n, device=device) for n in dataset.patch_shape]

    def _indices(
        self, indices: np.ndarray, origins: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """(items, origins) of ``indices`` on the device (one staged copy), items on the host.
        The origins are the dataset's patch sampler's for this epoch, as the DataLoader path
        cuts them (the stored index, or a uniform or foreground placement)."""
        ds = self.dataset
        items = ds.items[indices].astype(np.int64)
        if origins is None:
            origins = ds.patch_origins(indices)
        table = np.concatenate([items[:, None], origins.astype(np.int64)], axis=1)
        on_device = _to_device(table, self.device)
        return on_device[:, 0], on_device[:, 1:], items

    def _axes(self, origins: torch.Tensor) -> list[torch.Tensor]:
        """Voxel coordinates of each patch along each axis: (batch, patch size) per axis."""
        return [origins[:, a, None] + step for a, step in enumerate(self._steps)]

    def _batch(self, image: torch.Tensor, items: torch.Tensor) -> dict[str, Any]:
        batch = {"image": image[:, None], "item": items}
        if self.labels is not None:
            batch["labels"] = self.labels[items]
        return batch


def units_per_patch(dataset: CTPatchDataset) -> int:
    """Cache units one patch can overlap at most: ``(p + u - 2) // u + 1`` along each axis."""
    units = dataset.cache.groups[dataset.asset, dataset.window].units.max(axis=0)
    spans = [(p + u - 2) // u + 1 for p, u in zip(dataset.patch_shape, units, strict=True)]
    return int(np.prod(spans))


def _grid(terms: list[torch.Tensor]) -> torch.Tensor:
    """Sum of per-axis terms ``(batch, n_axis)`` broadcast to ``(batch, n_0, n_1, n_2)``."""
    z, y, x = terms
    return z[:, :, None, None] + y[:, None, :, None] + x[:, None, None, :]


class DevicePatches(_PatchSource):
    """A :class:`CTPatchDataset` (patch mode) with all its volumes and labels on ``device``."""

    def __init__(self, dataset: CTPatchDataset, device: torch.device) -> None:
        super().__init__(dataset, device)
        shapes = self.group.shapes.astype(np.int64)
        sizes = np.prod(shapes, axis=1)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        self.flat = torch.empty(int(starts[-1]), dtype=self.dtype, device=device)
        with warnings.catch_warnings():  # cache entries are read-only; copy_ only reads them
            warnings.simplefilter("ignore", UserWarning)
            for i in range(len(shapes)):
                volume = torch.from_numpy(dataset.array(i, dataset.window)).reshape(-1)
                self.flat[int(starts[i]) : int(starts[i + 1])].copy_(volume)
        # element strides of each volume (z, y) and where it starts in the flat tensor
        table = np.stack([starts[:-1], shapes[:, 1] * shapes[:, 2], shapes[:, 2]], axis=1)
        self._table = _to_device(table, device)

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def batch(self, indices: np.ndarray) -> dict[str, Any]:
        """The same batch as ``dataset.__getitems__(indices)``, cut on the device by one
        gather (the copies and kernels go to the current stream)."""
        items, origins, _ = self._indices(np.asarray(indices))
        start, zs, ys = self._table[items].unbind(1)
        z, y, x = self._axes(origins)
        where = _grid([start[:, None] + z * zs[:, None], y * ys[:, None], x])
        return self._batch(self.flat.take(where), items)


STAGES = 2  # pinned staging buffers: the host fills one while the other is copied up
STAGE_BYTES = 4 << 20  # each one's size: uploads go up in pieces of this much, a few per batch
GATHER_BYTES_PER_VOXEL = 12  # the gather's int64 unit ids, then int32 slots and int64 offsets


@dataclass(frozen=True)
class PoolLayout:
    """How a slot pool's byte budget is spent: slots for cache units, and everything else
    the pool keeps — the unit → slot table, the scans' unit grids and labels on the device,
    pinned staging in host memory (and its landing buffer on CUDA), and the scratch of one
    batch's gather."""

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
    """What sizing a slot pool needs to know of a patch dataset (:func:`pool_facts`)."""

    slot_bytes: int  # the largest cache unit, in bytes
    units: int  # cache units in the dataset
    scans: int
    unit_dims: int  # axes of a unit
    label_bytes: int
    units_per_patch: int  # units one patch can overlap at most
    patch_voxels: int
    uniform: bool  # every scan has the same unit shape (a pool needs it)
    augment: int = 0  # device bytes the dataset's augmentation takes per batch (0: none)


def pool_facts(dataset: CTPatchDataset, batch_size: int | None = None) -> PoolFacts:
    """The facts :func:`layout_pool` sizes a pool from, read from ``dataset``'s cache; its
    augmentation's scratch for batches of ``batch_size`` (needed when it has one)."""
    g = dataset.cache.groups[dataset.asset, dataset.window]
    return PoolFacts(
        slot_bytes=int(np.prod(g.units, axis=1).max()) * g.dtype.itemsize,
        units=int(g.offsets[-1]),
        scans=len(g.shapes),
        unit_dims=int(g.units.shape[1]),
        label_bytes=0 if dataset.labels is None else int(dataset.labels.nbytes),
        units_per_patch=units_per_patch(dataset),
        patch_voxels=int(np.prod(dataset.patch_shape)),
        uniform=len({tuple(u) for u in g.units.tolist()}) == 1,
        augment=augment_scratch(dataset, batch_size),
    )


def layout_pool(facts: PoolFacts, budget_bytes: int, batch_size: int) -> PoolLayout:
    """The slot pool that ``budget_bytes`` holds at ``batch_size``, the augmentation's
    scratch left free (its ``slots`` may be fewer than a batch needs: then there is no
    pool)."""
    slot_bytes = facts.slot_bytes
    # on the device: unit -> slot (int32); per scan its first unit, grid strides and unit
    # shape (int64); the labels
    tables = facts.units * 4 + facts.scans * (3 + facts.unit_dims) * 8 + facts.label_bytes
    need = batch_size * facts.units_per_patch
    stage = max(1, min(need, STAGE_BYTES // slot_bytes))
    # pinned buffers -> one landing buffer on the device -> slots; and their indices
    staging = (STAGES + 1) * stage * slot_bytes + STAGES * stage * 16
    gather = GATHER_BYTES_PER_VOXEL * batch_size * facts.patch_voxels
    augment = facts.augment
    slots = max(0, (int(budget_bytes) - tables - staging - gather - augment) // slot_bytes)
    return PoolLayout(slots, slot_bytes, stage, need, tables, staging, gather, augment)


def augment_scratch(dataset: CTPatchDataset, batch_size: int | None) -> int:
    """Device bytes the dataset's augmentation allocates for one batch (0: it has none)."""
    if dataset.augment is None:
        return 0
    if batch_size is None:
        raise ValueError(
            f"{type(dataset).__name__} augments its batches: the batch size is needed to "
            "size the augmentation's device scratch"
        )
    return dataset.augment.batch_scratch(dataset.load(0), batch_size)


def pool_layout(dataset: CTPatchDataset, budget_bytes: int, batch_size: int) -> PoolLayout:
    """The slot pool that ``budget_bytes`` holds for ``dataset`` at ``batch_size``, its
    augmentation's scratch counted."""
    return layout_pool(pool_facts(dataset, batch_size), budget_bytes, batch_size)


@dataclass
class PoolStats:
    """What the slot pool did: units uploaded (ahead of their block, or when a batch needed
    them), found resident, and evicted."""

    uploads: int = 0
    ahead: int = 0  # uploaded for the next block while this one trained
    on_demand: int = 0  # missing when a batch needed them
    hits: int = 0
    evictions: int = 0
    batches: int = 0
    per_batch_max: int = 0
    history: list[int] = field(default_factory=list)  # resident units after each batch


class DeviceSlots(_PatchSource):
    """A fixed pool of device slots, each holding one cache unit, all within ``budget_bytes``
    (:func:`pool_layout`: the slots, its tables, staging and gather scratch together).

    A batch's units are made resident first (missing ones read from the host cache — the
    in-RAM arrays or the out-of-core arena, through the cache's own ``read_into`` — into
    pinned staging and copied up asynchronously), evicting the least recently used units
    that this batch does not need; then its patches are cut by one gather.  With the block
    sampler, :meth:`plan_ahead` names this block's units and the next block's: the next
    block's are uploaded a few per batch while this one trains, evicting only units that
    neither block reads.  Every slot write and every gather goes to the same (current)
    stream, so a slot is never overwritten before the gathers that read it have run, and
    the batch owns its voxels.
    """

    def __init__(
        self, dataset: CTPatchDataset, device: torch.device, budget_bytes: int, batch_size: int
    ) -> None:
        super().__init__(dataset, device)
        g = self.group
        if len({tuple(u) for u in g.units.tolist()}) != 1:
            raise ValueError(f"{dataset.url}: {dataset.window} units differ between scans")
        self.unit = tuple(int(u) for u in g.units[0])
        self.unit_elems = int(np.prod(self.unit))
        self.budget_bytes = int(budget_bytes)
        self.layout = layout = pool_layout(dataset, budget_bytes, batch_size)
        self.slot_bytes, self.slots = layout.slot_bytes, layout.slots
        if self.slots < layout.need:
            raise ValueError(
                f"device cache budget {self.budget_bytes / 1e6:.1f} MB holds {self.slots} units "
                f"of {self.slot_bytes / 1e6:.2f} MB besides its tables, staging and gather "
                f"(and augmentation) scratch; a batch may need {layout.need}: raise "
                "dataloader.device_cache_gb or lower train.batch_size"
            )
        self.pool = torch.empty(self.slots * self.unit_elems, dtype=self.dtype, device=device)
        n_units = int(g.offsets[-1])
        self._slot_of = np.full(n_units, -1, np.int64)  # host mirror: the policy runs here
        self._unit_in = np.full(self.slots, -1, np.int64)
        self._last_use = np.zeros(self.slots, np.int64)
        self._keep = np.zeros(n_units, bool)  # read by this block or the next: not evicted
        self._ahead = np.zeros(0, np.int64)  # the next block's units still to upload
        self._quota, self._wait = 0, 0
        self._slot_of_dev = torch.full((n_units,), -1, dtype=torch.int32, device=device)
        grid = -(-g.shapes // g.units)
        # per scan: its first unit's id, the unit-grid strides (units per z, per y), unit shape
        table = np.concatenate(
            [g.offsets[:-1, None], grid[:, 1:2] * grid[:, 2:3], grid[:, 2:3], g.units], axis=1
        )
        self._table = _to_device(table.astype(np.int64), device)
        stage = (layout.stage_units, *self.unit)
        self._stages = [_pinned(stage, self.dtype, device) for _ in range(STAGES)]
        self._staged: list[Any] = [None] * STAGES  # each one's copy up, until it is done
        self._turn = 0
        self._landing = torch.empty(stage, dtype=self.dtype, device=device)
        self.stats = PoolStats()
        self._clock = 0

    def nbytes(self) -> int:
        """Bytes of the slots (what holds cache units)."""
        return self.pool.numel() * self.pool.element_size()

    def resident(self) -> int:
        return int((self._unit_in >= 0).sum())

    def plan_ahead(
        self, current: np.ndarray, following: np.ndarray, batches: int, wait: int = 0
    ) -> None:
        """This block reads units ``current``, the next one ``following``: keep both, and
        upload the missing ones of ``following`` over this block's next ``batches`` batches,
        starting after ``wait`` of them."""
        following = np.unique(np.asarray(following, np.int64))
        self._keep[:] = False
        self._keep[np.asarray(current, np.int64)] = True
        self._keep[following] = True
        self._ahead = following[self._slot_of[following] < 0]
        self._wait = wait
        self._quota = -(-len(self._ahead) // max(1, batches - wait))

    def ensure(self, units: np.ndarray) -> None:
        """Make ``units`` resident (uploading the missing ones) and mark them used."""
        units = np.unique(np.asarray(units, np.int64))
        if len(units) > self.slots:
            raise ValueError(f"{len(units)} units needed at once; the pool has {self.slots} slots")
        self._clock += 1
        have = self._slot_of[units]
        missing = units[have < 0]
        self._last_use[have[have >= 0]] = self._clock
        self.stats.hits += int((have >= 0).sum())
        if len(missing):
            slots = self._room(len(missing), spare_kept=False)
            self._upload(missing, slots)
            self.stats.on_demand += len(missing)
        self.stats.per_batch_max = max(self.stats.per_batch_max, len(units))

    def _room(self, n: int, spare_kept: bool) -> np.ndarray:
        """``n`` slots to fill (fewer with ``spare_kept`` when only units kept for this block
        or the next could make room): free ones first, then the least recently used units
        not read by the current batch — those neither block reads before the others."""
        free = np.flatnonzero(self._unit_in < 0)
        if len(free) < n:
            taken = np.flatnonzero(self._unit_in >= 0)
            taken = taken[self._last_use[taken] < self._clock]  # never the current batch's
            kept = self._keep[self._unit_in[taken]]
            if spare_kept:
                taken, kept = taken[~kept], kept[~kept]
            victims = taken[np.lexsort((self._last_use[taken], kept))][: n - len(free)]
            gone = self._unit_in[victims]
            self._slot_of[gone] = -1
            self._unit_in[victims] = -1
            self._slot_of_dev[_to_device(gone, self.device)] = -1
            self.stats.evictions += len(victims)
            free = np.sort(np.concatenate([free, victims]))
        return free[:n]

    def _advance(self) -> None:
        """Upload this batch's share of the next block's units, where room is left."""
        if self._wait:
            self._wait -= 1
            return
        if not len(self._ahead):
            return
        todo, self._ahead = self._ahead[: self._quota], self._ahead[self._quota :]
        todo = todo[self._slot_of[todo] < 0]
        if not len(todo):
            return
        slots = self._room(len(todo), spare_kept=True)
        if len(slots) < len(todo):  # the two blocks fill the pool: the rest comes on demand
            todo, self._ahead = todo[: len(slots)], self._ahead[:0]
        if len(todo):
            self._upload(todo, slots)
            self.stats.ahead += len(todo)

    def _upload(self, units: np.ndarray, slots: np.ndarray) -> None:
        """Read ``units`` from the host cache into pinned staging and copy them into
        ``slots``: per staging buffer, one asynchronous copy and one scatter on the current
        stream.  A staging buffer is refilled only once its previous copy has finished."""
        ds, g = self.dataset, self.group
        step = self.layout.stage_units
        for start in range(0, len(units), step):
            part, into = units[start : start + step], slots[start : start + step]
            turn = self._turn = (self._turn + 1) % STAGES
            if self._staged[turn] is not None:
                self._staged[turn].synchronize()  # the producer waits, never the step
            host = self._stages[turn][: len(part)]
            rows = host.numpy()
            requests = []
            for row, (grp, item, flat) in enumerate(ds.cache.units.locate(part)):
                region = tuple(
                    slice(r.start, min(r.stop, int(n)))
                    for r, n in zip(grp.unit_region(item, flat), g.shapes[item], strict=True)
                )
                inside = tuple(slice(0, r.stop - r.start) for r in region)
                requests.append((grp.asset, item, grp.name, region, rows[row][inside]))
            # locate() walks the units in id order, as they are here (sorted by np.unique)
            ds.cache.read_into(requests, threads=copy_threads())
            moved = self._landing[: len(part)]
            moved.copy_(host, non_blocking=True)
            if self.device.type == "cuda":  # the host may refill this buffer once it is done
                self._staged[turn] = torch.cuda.Event()
                self._staged[turn].record()
            where = _to_device(into, self.device)
            self.pool.view(self.slots, self.unit_elems).index_copy_(
                0, where, moved.reshape(len(part), -1)
            )
            self._slot_of_dev[_to_device(part, self.device)] = where.to(torch.int32)
            self._slot_of[part] = into
            self._unit_in[into] = part
            self._last_use[into] = self._clock
            self.stats.uploads += len(part)

    def batch(self, indices: np.ndarray) -> dict[str, Any]:
        """The same batch as ``dataset.__getitems__(indices)``: its units made resident,
        then cut by one gather; then a share of the next block's units goes up."""
        ds, indices = self.dataset, np.asarray(indices)
        placed = ds.patch_origins(indices)  # the units of these patches, wherever placed
        units = ds.cache.units.region_units(
            ds.asset, ds.window, ds.items[indices].astype(np.int64), placed, ds.patch_shape
        )
        self.ensure(units)
        items, origins, _ = self._indices(indices, placed)
        first, per_z, per_y, uz, uy, ux = self._table[items].unbind(1)
        z, y, x = self._axes(origins)
        cz, cy, cx = z // uz[:, None], y // uy[:, None], x // ux[:, None]
        # unit ids, then their slots, then voxel offsets: two batch-sized index tensors live
        # at a time (GATHER_BYTES_PER_VOXEL)
        unit = _grid([first[:, None] + cz * per_z[:, None], cy * per_y[:, None], cx])
        where = self._slot_of_dev[unit]
        del unit
        where = where.long().mul_(self.unit_elems)
        where += ((z - cz * uz[:, None]) * (uy * ux)[:, None])[:, :, None, None]
        where += ((y - cy * uy[:, None]) * ux[:, None])[:, None, :, None]
        where += (x - cx * ux[:, None])[:, None, None, :]
        out = self._batch(self.pool.take(where), items)
        del where
        self.stats.batches += 1
        self.stats.history.append(self.resident())
        self._advance()
        return out


def device_source(
    dataset: CTPatchDataset, device: torch.device, tier: str, budget_bytes: int, batch_size: int
) -> DevicePatches | DeviceSlots:
    """The device tier the loading plan chose, built (volumes uploaded; the slot pool
    allocated)."""
    if tier == "volumes":
        return DevicePatches(dataset, device)
    if tier == "slots":
        return DeviceSlots(dataset, device, budget_bytes, batch_size)
    raise ValueError(f"no device tier {tier!r} to build")
