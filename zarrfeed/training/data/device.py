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
  copies, evicting the least recently used units.  With the block sampler a block's units
  stay resident while it is read, and the next block's are uploaded ahead of the step.

Either way a batch's voxels are found by index arithmetic on the device and cut by one
``torch.take``, never a Python loop of slices, and the batch equals what the dataset's own
``__getitems__`` returns for the same indices.  :func:`plan_device` picks the regime from the
measured sizes and says why.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zarrfeed.processes import available_memory, usable_cpus
from zarrfeed.training.data.ct import CTPatchDataset

# Share of the device's free memory the device cache may take by default ("auto").
DEVICE_SHARE = 0.25
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


@dataclass
class PoolStats:
    """What the slot pool did: units uploaded, found resident, and evicted."""

    uploads: int = 0
    hits: int = 0
    evictions: int = 0
    batches: int = 0
    per_batch_max: int = 0
    history: list[int] = field(default_factory=list)  # resident units after each batch


class DeviceSlots(_PatchSource):
    """A fixed pool of device slots, each holding one cache unit, within ``budget_bytes``.

    A batch's units are made resident first (missing ones read from the host cache into one
    pinned buffer — the in-RAM arrays or the out-of-core arena, through the cache's own
    ``read_into`` on every core — and copied up asynchronously), evicting the least recently
    used units that this batch does not need; then its patches are cut by one gather.  Every
    slot write and every gather goes to the same (current) stream, so a slot is never
    overwritten before the gathers that read it have run, and the batch owns its voxels.
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
        self.slot_bytes = self.unit_elems * g.dtype.itemsize
        self.budget_bytes = int(budget_bytes)
        self.slots = self.budget_bytes // self.slot_bytes
        need = batch_size * units_per_patch(dataset)
        if self.slots < need:
            raise ValueError(
                f"device cache budget {self.budget_bytes / 1e6:.1f} MB holds {self.slots} units "
                f"of {self.slot_bytes / 1e6:.2f} MB; a batch may need {need}: raise "
                "dataloader.device_cache_gb or lower train.batch_size"
            )
        self.pool = torch.empty(self.slots * self.unit_elems, dtype=self.dtype, device=device)
        n_units = int(g.offsets[-1])
        self._slot_of = np.full(n_units, -1, np.int64)  # host mirror: the policy runs here
        self._unit_in = np.full(self.slots, -1, np.int64)
        self._last_use = np.zeros(self.slots, np.int64)
        self._slot_of_dev = torch.full((n_units,), -1, dtype=torch.int32, device=device)
        grid = -(-g.shapes // g.units)
        # per scan: its first unit's id, the unit-grid strides (units per z, per y), unit shape
        table = np.concatenate(
            [g.offsets[:-1, None], grid[:, 1:2] * grid[:, 2:3], grid[:, 2:3], g.units], axis=1
        )
        self._table = _to_device(table.astype(np.int64), device)
        self.stats = PoolStats()
        self._clock = 0

    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def resident(self) -> int:
        return int((self._unit_in >= 0).sum())

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
            free = np.flatnonzero(self._unit_in < 0)
            if len(free) < len(missing):  # evict the least recently used, never this batch's
                taken = np.flatnonzero(self._unit_in >= 0)
                taken = taken[self._last_use[taken] < self._clock]
                old = taken[np.argsort(self._last_use[taken], kind="stable")]
                victims = old[: len(missing) - len(free)]
                gone = self._unit_in[victims]
                self._slot_of[gone] = -1
                self._unit_in[victims] = -1
                self._slot_of_dev[_to_device(gone, self.device)] = -1
                self.stats.evictions += len(victims)
                free = np.sort(np.concatenate([free, victims]))
            slots = free[: len(missing)]
            self._upload(missing, slots)
            self._slot_of[missing] = slots
            self._unit_in[slots] = missing
            self._last_use[slots] = self._clock
            self.stats.uploads += len(missing)
        self.stats.per_batch_max = max(self.stats.per_batch_max, len(units))

    def _upload(self, units: np.ndarray, slots: np.ndarray) -> None:
        """Read ``units`` from the host cache into one pinned buffer and copy it into
        ``slots`` (one asynchronous copy and one scatter on the current stream)."""
        ds, g = self.dataset, self.group
        staged = _pinned((len(units), *self.unit), self.dtype, self.device)
        host = staged.numpy()
        requests = []
        for row, (grp, item, flat) in enumerate(ds.cache.units.locate(units)):
            region = tuple(
                slice(r.start, min(r.stop, int(n)))
                for r, n in zip(grp.unit_region(item, flat), g.shapes[item], strict=True)
            )
            part = tuple(slice(0, r.stop - r.start) for r in region)
            requests.append((grp.asset, item, grp.name, region, host[row][part]))
        # locate() walks the units in id order: ``units`` is sorted (np.unique), rows agree
        ds.cache.read_into(requests, threads=usable_cpus())
        moved = staged.to(self.device, non_blocking=True).reshape(len(units), -1)
        where = _to_device(slots, self.device)
        self.pool.view(self.slots, self.unit_elems).index_copy_(0, where, moved)
        self._slot_of_dev[_to_device(units, self.device)] = where.to(torch.int32)

    def batch(self, indices: np.ndarray) -> dict[str, Any]:
        """The same batch as ``dataset.__getitems__(indices)``: its units made resident,
        then cut by one gather."""
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
        unit = _grid([first[:, None] + cz * per_z[:, None], cy * per_y[:, None], cx])
        local = _grid(
            [(z - cz * uz[:, None]) * (uy * ux)[:, None], (y - cy * uy[:, None]) * ux[:, None],
             x - cx * ux[:, None]]
        )  # fmt: skip
        where = self._slot_of_dev[unit].long() * self.unit_elems + local
        self.stats.batches += 1
        self.stats.history.append(self.resident())
        return self._batch(self.pool.take(where), items)


@dataclass
class DevicePlan:
    """Which device tier serves the batches, and why."""

    tier: str  # "volumes", "slots" or "off"
    budget_bytes: int
    reasons: list[str]


def device_budget(device: torch.device, configured_gb: float | None) -> tuple[int, str]:
    """Bytes the device cache may take: as configured, else ``DEVICE_SHARE`` of the free
    device memory (of the available RAM on the CPU)."""
    if configured_gb is not None:
        return int(configured_gb * (1 << 30)), f"{configured_gb:g} GiB as configured"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(DEVICE_SHARE * free), f"{DEVICE_SHARE:g} x {free / 1e9:.1f} GB free on {device}"
    free = available_memory()
    return int(DEVICE_SHARE * free), f"{DEVICE_SHARE:g} x {free / 1e9:.1f} GB available RAM"


def plan_device(
    dataset: Any,
    device: torch.device,
    mode: str,
    batch_size: int,
    configured_gb: float | None = None,
) -> DevicePlan:
    """The device tier for ``mode`` ("auto": on CUDA only; "on": on any device; "off").

    The dataset's volumes go to the device when they fit its budget; otherwise a pool of
    slots within the budget holds the units the batches read, as long as one batch's units
    fit; otherwise batches come from the DataLoader."""
    if mode == "off":
        return DevicePlan("off", 0, ["device cache: off (as configured)"])
    if not (isinstance(dataset, CTPatchDataset) and dataset.patch):
        why = "it cuts CT patches only"
        return DevicePlan("off", 0, [f"device cache: off ({why}; {type(dataset).__name__})"])
    if dataset.transform is not None:
        why = "its transform runs per sample on the host"
        return DevicePlan("off", 0, [f"device cache: off ({why}: the DataLoader path applies it)"])
    if mode == "auto" and device.type != "cuda":
        return DevicePlan("off", 0, [f"device cache: off (auto: {device} is not a CUDA device)"])
    budget, how = device_budget(device, configured_gb)
    size = dataset.nbytes()
    if size <= budget:
        return DevicePlan(
            "volumes",
            budget,
            [f"device cache: volumes held on {device} ({size / 1e9:.2f} GB <= {how})"],
        )
    g = dataset.cache.groups[dataset.asset, dataset.window]
    unit_bytes = int(np.prod(g.units, axis=1).max()) * g.dtype.itemsize
    need = batch_size * units_per_patch(dataset) * unit_bytes
    if need > budget or len({tuple(u) for u in g.units.tolist()}) != 1:
        why = (
            f"a batch may need {need / 1e6:.1f} MB of units > {how}"
            if need > budget
            else "scans have different cache units"
        )
        return DevicePlan("off", 0, [f"device cache: off ({size / 1e9:.2f} GB > {how}; {why})"])
    slots = budget // unit_bytes
    return DevicePlan(
        "slots",
        budget,
        [
            f"device cache: {slots} slots of {unit_bytes / 1e6:.2f} MB units on {device} "
            f"({size / 1e9:.2f} GB > {how}): units uploaded from the host cache ahead of the "
            "step, least recently used evicted"
        ],
    )


def device_source(
    dataset: CTPatchDataset, device: torch.device, plan: DevicePlan, batch_size: int
) -> DevicePatches | DeviceSlots:
    """The tier ``plan`` chose, built (volumes uploaded; the slot pool allocated)."""
    if plan.tier == "volumes":
        return DevicePatches(dataset, device)
    if plan.tier == "slots":
        return DeviceSlots(dataset, device, plan.budget_bytes, batch_size)
    raise ValueError(f"no device tier to build: {plan.reasons}")
