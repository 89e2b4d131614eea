"""The dataset does not fit the device budget: a fixed pool of equal device slots holds
cache units, uploaded from the host cache ahead of the step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zarrfeed.eviction import victims
from zarrfeed.training.data.device.common import (
    CutSource,
    c_strides,
    gather,
    grid,
    held_dtype,
    pinned,
    restored,
    to_device,
)
from zarrfeed.training.data.device.pool import STAGES, pool_layout
from zarrfeed.training.data.reader import copy_threads


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


class DeviceSlots(CutSource):
    """A fixed pool of device slots, each holding one cache unit, all within ``budget_bytes``
    (:func:`~.pool.pool_layout`: the slots, its tables, staging and gather scratch together).

    A batch's units are made resident first (missing ones read from the host cache — the
    in-RAM arrays or the out-of-core arena, through the cache's own ``read_into`` — into
    pinned staging and copied up asynchronously), evicting the least recently used units
    that this batch does not need; then each array's boxes are cut by one gather.  With the
    block sampler, :meth:`plan_ahead` names this block's units and the next block's: the
    next block's are uploaded a few per batch while this one trains, evicting only units
    that neither block reads.  Every slot write and every gather goes to the same (current)
    stream, so a slot is never overwritten before the gathers that read it have run, and
    the batch owns its elements.  Slots are bytes: arrays of any dtype share one pool.
    """

    def __init__(
        self, dataset: Any, device: torch.device, budget_bytes: int, batch_size: int
    ) -> None:
        super().__init__(dataset, device)
        for g in self.groups.values():
            if len({tuple(u) for u in g.units.tolist()}) != 1:
                raise ValueError(f"{dataset.url}: {g.name} units differ between partitions")
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
        self.pool = torch.empty(self.slots * self.slot_bytes, dtype=torch.uint8, device=device)
        n_units = max(int(g.offsets[-1]) for g in dataset.cache.groups.values())
        self._slot_of = np.full(n_units, -1, np.int64)  # host mirror: the policy runs here
        self._unit_in = np.full(self.slots, -1, np.int64)
        self._last_use = np.zeros(self.slots, np.int64)
        self._keep = np.zeros(n_units, bool)  # read by this block or the next: not evicted
        self._ahead = np.zeros(0, np.int64)  # the next block's units still to upload
        self._quota, self._wait = 0, 0
        self._slot_of_dev = torch.full((n_units,), -1, dtype=torch.int32, device=device)
        self._tables: dict[tuple[str, str], torch.Tensor] = {}
        for g in self.groups.values():
            grid_shape = -(-g.shapes // g.units)
            # per partition: its first unit's id, the unit-grid strides (but the last, 1),
            # the unit shape and the unit's element strides (but the last, 1)
            table = np.concatenate(
                [g.offsets[:-1, None], c_strides(grid_shape)[:, :-1], g.units,
                 c_strides(g.units)[:, :-1]], axis=1,
            )  # fmt: skip
            self._tables[g.asset, g.name] = to_device(table.astype(np.int64), device)
        stage = (layout.stage_units, self.slot_bytes)
        self._stages = [pinned(stage, torch.uint8, device) for _ in range(STAGES)]
        self._staged: list[Any] = [None] * STAGES  # each one's copy up, until it is done
        self._turn = 0
        self._landing = torch.empty(stage, dtype=torch.uint8, device=device)
        self.counts = PoolStats()
        self._clock = 0

    def nbytes(self) -> int:
        """Bytes of the slots (what holds cache units)."""
        return self.pool.numel() * self.pool.element_size()

    @property
    def capacity_bytes(self) -> int:
        """Bytes of units it can hold at once (its slots; the rest of the budget is tables,
        staging and scratch)."""
        return self.slots * self.slot_bytes

    def resident(self) -> int:
        return int((self._unit_in >= 0).sum())

    def stats(self) -> dict[str, int]:
        """Units found resident (hits), uploaded when a batch needed them (misses), bytes
        uploaded, evictions, units and bytes held; and the uploads made ahead of a block."""
        held = self.resident()
        return {
            "hits": self.counts.hits,
            "misses": self.counts.on_demand,
            "bytes_decoded": self.counts.uploads * self.slot_bytes,
            "evictions": self.counts.evictions,
            "entries": held,
            "bytes_held": held * self.slot_bytes,
            "budget_bytes": self.budget_bytes,
            "uploads": self.counts.uploads,
            "ahead": self.counts.ahead,
            "batches": self.counts.batches,
        }

    def clear(self) -> None:
        """Empty every slot and the counts (the next batches upload what they read)."""
        self.close()
        self._slot_of[:] = -1
        self._unit_in[:] = -1
        self._slot_of_dev.fill_(-1)
        self._ahead = self._ahead[:0]
        self.counts = PoolStats()

    def close(self) -> None:
        """Wait for the copies up still in flight (the staging buffers are then free)."""
        for i, event in enumerate(self._staged):
            if event is not None:
                event.synchronize()
                self._staged[i] = None

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
        self.counts.hits += int((have >= 0).sum())
        if len(missing):
            slots = self._room(len(missing), spare_kept=False)
            self._upload(missing, slots)
            self.counts.on_demand += len(missing)
        self.counts.per_batch_max = max(self.counts.per_batch_max, len(units))

    def _room(self, n: int, spare_kept: bool) -> np.ndarray:
        """``n`` slots to fill (fewer with ``spare_kept`` when only units kept for this block
        or the next could make room): free ones first, then the least recently used units
        not read by the current batch — those neither block reads before the others."""
        free = np.flatnonzero(self._unit_in < 0)
        if len(free) < n:
            taken = np.flatnonzero(self._unit_in >= 0)
            used = self._last_use[taken]
            kept = self._keep[self._unit_in[taken]]
            current = used >= self._clock  # never the current batch's
            protected = current | kept if spare_kept else current
            chosen = victims(used, n - len(free), priority=kept, protected=protected)
            gone_slots = taken[chosen]
            gone = self._unit_in[gone_slots]
            self._slot_of[gone] = -1
            self._unit_in[gone_slots] = -1
            self._slot_of_dev[to_device(gone, self.device)] = -1
            self.counts.evictions += len(gone_slots)
            free = np.sort(np.concatenate([free, gone_slots]))
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
            self.counts.ahead += len(todo)

    def _upload(self, units: np.ndarray, slots: np.ndarray) -> None:
        """Read ``units`` from the host cache into pinned staging and copy them into
        ``slots``: per staging buffer, one asynchronous copy and one scatter on the current
        stream.  A staging buffer is refilled only once its previous copy has finished.  A
        pool in host memory (device ``cpu``) is read into straight, slot by slot: staging
        would only copy the same bytes twice more on the cores the model steps on."""
        cache = self.dataset.cache
        direct = self.device.type == "cpu"
        slot_rows = self.pool.view(self.slots, self.slot_bytes).numpy() if direct else None
        step = self.layout.stage_units
        for start in range(0, len(units), step):
            part, into = units[start : start + step], slots[start : start + step]
            turn = self._turn = (self._turn + 1) % STAGES
            if self._staged[turn] is not None:
                self._staged[turn].synchronize()  # the producer waits, never the step
            host = self._stages[turn][: len(part)]
            rows = host.numpy() if slot_rows is None else None
            requests = []
            for row, (g, item, flat) in enumerate(cache.units.locate(part)):
                unit = tuple(int(u) for u in g.units[item])
                region = tuple(
                    slice(r.start, min(r.stop, int(n)))
                    for r, n in zip(g.unit_region(item, flat), g.shapes[item], strict=True)
                )
                inside = tuple(slice(0, r.stop - r.start) for r in region)
                target = rows[row] if slot_rows is None else slot_rows[into[row]]
                cell = target[: int(np.prod(unit)) * g.dtype.itemsize].view(g.dtype)
                requests.append((g.asset, item, g.name, region, cell.reshape(unit)[inside]))
            # locate() walks the units in id order, as they are here (sorted by np.unique)
            cache.read_into(requests, threads=copy_threads())
            where = to_device(into, self.device)
            if not direct:
                moved = self._landing[: len(part)]
                moved.copy_(host, non_blocking=True)
                if self.device.type == "cuda":  # the host may refill this buffer once done
                    self._staged[turn] = torch.cuda.Event()
                    self._staged[turn].record()
                self.pool.view(self.slots, self.slot_bytes).index_copy_(0, where, moved)
            self._slot_of_dev[to_device(part, self.device)] = where.to(torch.int32)
            self._slot_of[part] = into
            self._unit_in[into] = part
            self._last_use[into] = self._clock
            self.counts.uploads += len(part)

    def batch(self, indices: np.ndarray) -> dict[str, Any]:
        """The same batch as the dataset's DataLoader path yields for ``indices``: its units
        made resident, then each array's boxes cut by one gather; then a share of the next
        block's units goes up."""
        cuts = self.cuts(indices)
        units = self.dataset.cache.units
        needed = [
            units.region_units(s.asset, s.name, b.items, b.origins, s.shape)
            for s, b in ((self.specs[k], b) for k, b in cuts.boxes.items())
        ]
        self.ensure(np.concatenate(needed))
        boxes, extras = self.up(cuts)
        cut = {key: self._gather(key, *placed) for key, placed in boxes.items()}
        out = self.dataset.device_finish(cut, extras)
        self.counts.batches += 1
        self.counts.history.append(self.resident())
        self._advance()
        return out

    def _gather(self, key: str, items: torch.Tensor, origins: torch.Tensor) -> torch.Tensor:
        """The boxes of batch key ``key`` (their partitions and origins on the device), cut
        from the slots by one gather."""
        g = self.groups[key]
        dims = origins.shape[1]
        row = self._tables[g.asset, g.name][items]
        first, unit_shape = row[:, 0], row[:, dims : 2 * dims]
        axes = self.axes(key, origins)
        cells = [axes[a] // unit_shape[:, a, None] for a in range(dims)]
        terms = [cells[a] * row[:, 1 + a, None] for a in range(dims - 1)] + [cells[-1]]
        terms[0] = terms[0] + first[:, None]
        inside = [axes[a] - cells[a] * unit_shape[:, a, None] for a in range(dims)]
        inside[:-1] = [inside[a] * row[:, 2 * dims + a, None] for a in range(dims - 1)]
        # unit ids, then their slots, then element offsets: two batch-sized index tensors
        # live at a time (GATHER_BYTES_PER_VOXEL).  Each is one pass over the batch (the
        # per-axis terms are summed before the last axis broadcasts them), and the slot
        # lookup and the cut are index_selects: what the step's cores spend on the gather.
        unit = grid(terms)
        slot = gather(self._slot_of_dev, unit)
        del unit
        where = grid(inside).add_(slot, alpha=self.slot_bytes // g.dtype.itemsize)
        del slot
        return restored(gather(self.pool.view(held_dtype(g.dtype)), where), g.dtype)
