"""The arrays a dataset reads, decoded once per machine into shared memory, read through the
store API only (local folders and object stores alike).

Two regimes behind one interface, picked from the dataset's decoded size and its budget:

* **in RAM** — the dataset fits: each array is decoded whole into a
  :class:`~zarrfeed.training.data.arrays.SharedArrayCache` entry (before the workers start,
  by :meth:`CachedArrays.preload`), and a sample is one slice of it;
* **out of core** — it does not: the unit of caching is the stored chunk (or a chunk-aligned
  block of small chunks, :mod:`~zarrfeed.training.data.units`), held in a
  :class:`~zarrfeed.training.data.arena.ChunkArena` of exactly the budget.  A read decodes
  only the units it overlaps that are not resident.

Every cached byte is keyed by what it is: the store's resolved location
(``ZarrStore.identity``), the asset, the partition, its committed version (from the dataset
manifest), the array and the unit — a rebuilt partition or another store can never be served
from an old entry.  Each array is checked against the manifest on first use.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from zarrfeed.errors import StoreError
from zarrfeed.processes import usable_cpus
from zarrfeed.processlocal import ProcessLocal
from zarrfeed.store import ChunkedArray, ZarrStore
from zarrfeed.training.data.arena import MASK, ChunkArena
from zarrfeed.training.data.arrays import Fill, SharedArrayCache
from zarrfeed.training.data.shm import CacheFolder
from zarrfeed.training.data.units import Region, UnitIndex, clip

log = logging.getLogger("zarrfeed.training")

MIN_SLOTS = 16  # an arena with fewer slots than this would thrash: read directly instead
ROUNDS = 4  # attempts to read a unit through the arena before decoding it privately
PREFETCH_BATCH = 4  # units claimed, decoded and published together ahead of the readers
HANDLES = 256  # stored arrays each process keeps open (one per partition and array name)
Request = tuple[str, int, str, Region, np.ndarray]  # asset, item, array, region, destination


class CachedArrays:
    """Decoded arrays of a dataset's partitions through one shared cache per machine.

    ``sources`` maps each asset to its manifest partitions (``key``, ``version``, ``arrays``)
    and the array names to cache.  Pickles to workers without handles: each process opens
    the store and maps the cache itself.
    """

    def __init__(
        self,
        store: ZarrStore,
        sources: dict[str, tuple[list[dict[str, Any]], list[str]]],
        budget_bytes: int,
    ) -> None:
        self.url, self.identity = store.url, store.identity
        self.storage_options = getattr(store.backend, "storage_options", None)
        self.budget_bytes = int(budget_bytes)
        self.units = UnitIndex(sources)
        self.groups, self.nbytes = self.units.groups, self.units.nbytes
        self.unit_bytes = self.units.unit_bytes
        self.in_ram = self.nbytes <= self.budget_bytes
        what = {a: sorted(n for b, n in self.groups if b == a) for a, _ in self.groups}
        meta = {"store": self.url, "identity": self.identity, "arrays": what}
        if self.in_ram:
            self.entries = SharedArrayCache(
                f"{self.identity}|{sorted(what.items())}", self.budget_bytes, meta
            )
            self.arena = None
        else:
            digest = hashlib.sha256(
                f"{self.identity}|{sorted(what.items())}|{self.budget_bytes}|{self.unit_bytes}".encode()
            ).hexdigest()[:16]
            folder = CacheFolder("chunks", digest, meta | {"budget_bytes": self.budget_bytes})
            self.arena = ChunkArena(folder, self.budget_bytes, self.unit_bytes)
            self.entries = None
            if self.arena.slots < MIN_SLOTS:
                log.warning(
                    "cache budget %.3f GB holds %d units of %.2f MB (< %d): arrays of %s are "
                    "read from the store without caching; raise cache_gb",
                    self.budget_bytes / 1e9,
                    self.arena.slots,
                    self.unit_bytes / 1e6,
                    MIN_SLOTS,
                    self.url,
                )
        self._local = ProcessLocal(_Handles)

    @property
    def capacity_bytes(self) -> int:
        """Bytes of decoded data the cache can hold at once."""
        if self.arena is None:
            return self.budget_bytes
        return self.arena.capacity_bytes if self.arena.slots >= MIN_SLOTS else 0

    # per-process handles ----------------------------------------------------------------------
    def _pool(self, threads: int) -> ThreadPoolExecutor:
        local = self._local.get()
        if local.pool is None or local.pool[0] != threads:
            local.pool = (threads, ThreadPoolExecutor(threads, thread_name_prefix="zarrfeed-copy"))
        return local.pool[1]

    @property
    def store(self) -> ZarrStore:
        local = self._local.get()
        if local.store is None:
            local.store = ZarrStore(self.url, self.storage_options)
        return local.store

    def chunked(self, asset: str, item: int, name: str) -> ChunkedArray:
        """The stored array, pinned to the manifest's version and checked against it (the
        last :data:`HANDLES` opened stay open in each process)."""
        handles = self._local.get().arrays
        found = handles.pop((asset, item, name), None)
        if found is None:
            g = self.groups[asset, name]
            key = g.keys[item]
            found = self.store.chunked(asset, key, name, self._version(asset, item, name))
            want = tuple(int(n) for n in g.shapes[item])
            if found.shape != want or found.dtype != g.dtype:
                raise StoreError(
                    f"partition {asset}/{key} array {name!r} is {found.dtype} {found.shape}; "
                    f"the manifest says {g.dtype} {want}: rebuild the manifest"
                )
            while len(handles) >= HANDLES:
                handles.pop(next(iter(handles)))
        handles[asset, item, name] = found  # most recently used last
        return found

    def _version(self, asset: str, item: int, name: str) -> str:
        """The manifest's version of a partition."""
        return self.groups[asset, name].versions[item]

    def entry_key(self, asset: str, item: int, name: str) -> str:
        """What an in-RAM entry is: store identity, asset, partition, version, array."""
        key = self.groups[asset, name].keys[item]
        return f"{self.identity}\0{asset}\0{key}\0{self._version(asset, item, name)}\0{name}"

    def _base(self, asset: str, item: int, name: str) -> tuple[int, int]:
        """128-bit key of unit 0 of an array; unit ``i`` is ``(hi, lo + i)``."""
        bases = self._local.get().bases
        found = bases.get((asset, item, name))
        if found is None:
            unit = ",".join(str(int(u)) for u in self.groups[asset, name].units[item])
            digest = hashlib.blake2b(
                f"{self.entry_key(asset, item, name)}\0{unit}".encode(), digest_size=16
            ).digest()
            found = bases[asset, item, name] = (
                int.from_bytes(digest[:8], "little"),
                int.from_bytes(digest[8:], "little"),
            )
        return found

    # whole arrays -----------------------------------------------------------------------------
    def _fill(self, asset: str, item: int, name: str, threads: int | None = None) -> Fill:
        g = self.groups[asset, name]
        shape = tuple(int(n) for n in g.shapes[item])

        def into(out: np.ndarray) -> np.ndarray:
            return self.chunked(asset, item, name).read_into(out, threads)

        return Fill(shape, g.dtype, into)

    def array(self, asset: str, item: int, name: str) -> np.ndarray:
        """All of an array: read-only shared memory in RAM, a private array out of core."""
        if self.entries is not None:
            key = self.entry_key(asset, item, name)
            return self.entries.get(key, self._fill(asset, item, name))
        g = self.groups[asset, name]
        out = np.empty(tuple(int(n) for n in g.shapes[item]), g.dtype)
        self.read_into([(asset, item, name, tuple(slice(0, n) for n in out.shape), out)])
        return out

    def preload(self) -> None:
        """Decode every array into the in-RAM cache, evicting entries of other versions.

        Arrays are filled side by side, one per usable core: a fill is half kernel work on
        fresh shared memory (allocating and mapping its pages, one core) and half decoding,
        so one fill at a time leaves a core idle for half of the time.
        """
        if self.entries is None:
            return
        arrays = [(a, item, n) for (a, n), g in self.groups.items() for item in range(len(g.keys))]

        def fill(array: tuple[str, int, str]) -> str:
            key = self.entry_key(*array)
            self.entries.get(key, self._fill(*array, threads=1))
            return key

        threads = usable_cpus()
        if threads > 1 and len(arrays) > 1:
            keys = set(self._pool(threads).map(fill, arrays))
        else:
            keys = {fill(array) for array in arrays}
        self.entries.drop_others(keys)

    # regions ----------------------------------------------------------------------------------
    def read(self, asset: str, item: int, name: str, region: Region) -> np.ndarray:
        """A new array holding ``region`` (one slice per axis, steps of 1)."""
        g = self.groups[asset, name]
        region = clip(region, g.shapes[item])
        out = np.empty(tuple(s.stop - s.start for s in region), g.dtype)
        self.read_into([(asset, item, name, region, out)])
        return out

    def read_into(self, requests: Sequence[Request], threads: int = 1) -> None:
        """Copy each request's region into its destination (region-shaped), on up to
        ``threads`` threads (:func:`copy_threads`: what this process may use).

        What a batch costs besides its copies is paid once per batch, not per patch: in RAM,
        each array it reads is looked up once (one LRU-clock update and one statistics update
        per array); out of core, the pieces of the units each region overlaps are worked out
        in one pass and copied out of the arena under one seqlock check.
        """
        if not requests:
            return
        if self.entries is not None:
            self._read_resident(requests, threads)
            return
        arena = self.arena
        if arena.slots < MIN_SLOTS:
            for asset, item, name, region, out in requests:
                self.chunked(asset, item, name).read_region_into(region, out)
            return
        pieces = [p for r in requests for p in self._pieces(*r)]
        for attempt in range(ROUNDS):
            left = self._copy_pieces(pieces, threads)
            if not attempt:
                arena.count("hits", len(pieces) - len(left))
            if not left:
                return
            self._fetch(left)
            pieces = left
        for p in pieces:  # the arena is too small for what is read at once: decode privately
            self.chunked(p.asset, p.item, p.name).read_region_into(p.region, p.dst)

    def _read_resident(self, requests: Sequence[Request], threads: int) -> None:
        """In RAM: one lookup per array, then one copy per region."""
        by_array: dict[tuple[str, int, str], list[tuple[Region, np.ndarray]]] = {}
        for asset, item, name, region, out in requests:
            by_array.setdefault((asset, item, name), []).append((region, out))
        keys = self._local.get().keys
        copies: list[tuple[torch.Tensor, Region, np.ndarray]] = []
        for (asset, item, name), regions in by_array.items():
            key = keys.get((asset, item, name))
            if key is None:
                key = keys[asset, item, name] = self.entry_key(asset, item, name)
            whole = self.entries.tensor(key, reads=len(regions))
            if whole is None:
                filled = self.entries.get(key, self._fill(asset, item, name), wait=False)
                whole = None if filled is None else self.entries.tensor(key, reads=0)
            if whole is None:  # another process is decoding it: read just these parts
                data = self.chunked(asset, item, name)
                for region, out in regions:
                    data.read_region_into(region, out)
                continue
            copies += [(whole, region, out) for region, out in regions]
        # Torch copies a strided 3-D region ~1.4x faster than numpy, and spreads each copy
        # over its own intra-op threads when it has several: copy threads of ours only when
        # it has one (DataLoader workers), or they would each start a team of its threads.
        threads = min(threads, len(copies)) if torch.get_num_threads() == 1 else 1
        if threads > 1:
            list(
                self._pool(threads).map(_copy_regions, [copies[i::threads] for i in range(threads)])
            )
        else:
            _copy_regions(copies)

    def _copy_pieces(self, pieces: Sequence[_Piece], threads: int) -> list[_Piece]:
        """Copy the pieces out of the arena; those not copied (not resident)."""
        # Two cores or fewer: the block sampler's prefetch thread decodes on one of them
        # (measured: two copy threads beside it were 10 % slower on two cores).
        threads = min(threads, len(pieces)) if threads > 2 else 1
        if threads > 1:
            parts = [pieces[i::threads] for i in range(threads)]
            return [p for left in self._pool(threads).map(self._copy_part, parts) for p in left]
        return self._copy_part(pieces)

    def _copy_part(self, pieces: Sequence[_Piece]) -> list[_Piece]:
        left: list[_Piece] = []
        arena = self.arena
        by_shape: dict[tuple[np.dtype, tuple[int, ...]], list[_Piece]] = {}
        for p in pieces:
            by_shape.setdefault((p.dtype, p.unit), []).append(p)
        for (dtype, unit), group in by_shape.items():
            missed = arena.copy_many(
                [p.key for p in group], dtype, unit, [p.src for p in group], [p.dst for p in group]
            )
            left += [group[i] for i in missed]
        return left

    def _pieces(
        self, asset: str, item: int, name: str, region: Region, out: np.ndarray | None
    ) -> list[_Piece]:
        """The parts of the units that ``region`` overlaps (no destination when ``out`` is
        None: whole units to prefetch).  Each axis's spans are worked out once; a piece is
        one combination of them."""
        g = self.groups[asset, name]
        unit = tuple(int(u) for u in g.units[item])
        shape = tuple(int(n) for n in g.shapes[item])
        region = clip(region, shape)
        hi, lo = self._base(asset, item, name)
        axes, stride = [], 1
        for s, u, n in reversed(list(zip(region, unit, shape, strict=True))):
            spans = []
            for c in range(s.start // u, -(-s.stop // u)):
                a, b = max(s.start, c * u), min(s.stop, (c + 1) * u)
                spans.append(
                    (c, c * stride, slice(a - c * u, b - c * u), slice(a - s.start, b - s.start),
                     slice(a, b))
                )  # fmt: skip
            axes.append(spans)
            stride *= -(-n // u)
        axes.reverse()
        found = []
        for combo in itertools.product(*axes):
            coords, flat, src, dst, whole = zip(*combo, strict=True)
            key = (hi, (lo + sum(flat)) & MASK)
            part = None if out is None else out[dst]
            found.append(_Piece(key, asset, item, name, coords, g.dtype, unit, src, part, whole))
        return found

    def _fetch(self, pieces: Sequence[_Piece], wait: bool = True) -> None:
        """Decode the units of ``pieces`` that nobody holds into claimed slots, and (with
        ``wait``) wait for those that another process is decoding."""
        arena = self.arena
        units = {p.key: p for p in pieces}
        claimed, busy = arena.claim(list(units))
        if claimed:
            try:
                self._decode([(units[k], s) for k, s in claimed])
            except BaseException:
                arena.abandon(claimed)
                raise
            arena.publish(claimed)
        for key, s in busy if wait else ():
            arena.wait(key, s)

    def _decode(self, work: Sequence[tuple[_Piece, int]]) -> None:
        """Decode whole units into their slots, grouped by array (one batched chunk fetch per
        array when the unit is the stored chunk)."""
        arena, decoded = self.arena, 0
        by_array: dict[tuple[str, int, str], list[tuple[_Piece, int]]] = {}
        for p, s in work:
            by_array.setdefault((p.asset, p.item, p.name), []).append((p, s))
        for (asset, item, name), units in by_array.items():
            data = self.chunked(asset, item, name)
            views = [arena.view(s, p.dtype, p.unit) for p, s in units]
            if data.chunks == units[0][0].unit:
                data.read_chunks_into([p.coords for p, _ in units], views, threads=1)
            else:
                for (p, _), view in zip(units, views, strict=True):
                    region = clip(
                        tuple(
                            slice(c * u, (c + 1) * u) for c, u in zip(p.coords, p.unit, strict=True)
                        ),
                        np.asarray(data.shape),
                    )
                    part = tuple(slice(0, r.stop - r.start) for r in region)
                    data.read_region_into(region, view[part], threads=1)
            decoded += len(units) * views[0].nbytes
        arena.count("misses", len(work))
        arena.count("bytes_decoded", decoded)

    def prefetch(
        self,
        ids: np.ndarray,
        wanted: Callable[[], bool] = lambda: True,
        keep: np.ndarray | None = None,
    ) -> None:
        """Decode units ``ids`` that are not resident (a few at a time, until ``wanted()`` is
        false): the block sampler calls it for the next block while this one is read.  Units
        ``keep`` (the block being read) are marked as used first, so that room is made by
        evicting older blocks, not the current one."""
        if self.arena is None:
            done = set()
            for g, item, _ in self.units.locate(ids):
                if not wanted():
                    return
                if (g.asset, item, g.name) not in done:
                    done.add((g.asset, item, g.name))
                    self.array(g.asset, item, g.name)
            return
        if self.arena.slots < MIN_SLOTS:
            return
        if keep is not None:
            self.arena.touch([p.key for p in self._units(keep)])
        for start in range(0, len(ids), PREFETCH_BATCH):
            if not wanted():
                return
            units = self._units(ids[start : start + PREFETCH_BATCH])
            missing = [p for p in units if not self.arena.holds(p.key)]
            if missing:
                self._fetch(missing, wait=False)

    def read_ahead(self, ids: np.ndarray, wanted: Callable[[], bool] = lambda: True) -> None:
        """From an object store, fetch the chunks of units ``ids`` not resident into the
        disk tier, one concurrent read per array, without decoding them or touching the
        arena (what decoding them a few at a time would fetch in as many round trips); the
        block sampler calls it a whole block ahead.  Local stores and tier-less ones skip it."""
        if self.arena is None or self.store.local or self.store.tier is None:
            return
        by_array: dict[tuple[str, int, str], list[_Piece]] = {}
        for p in self._units(ids):
            if not self.arena.holds(p.key):
                by_array.setdefault((p.asset, p.item, p.name), []).append(p)
        for (asset, item, name), pieces in by_array.items():
            if not wanted():
                return
            data = self.chunked(asset, item, name)
            if data.layout is not None:
                coords = {c for p in pieces for c in data.layout.chunks_of(p.region)}
                data.warm(sorted(coords))

    def resident(self, ids: np.ndarray) -> np.ndarray:
        """Whether each unit is in the arena (or being decoded into it) right now."""
        return np.array([self.arena.holds(p.key) for p in self._units(ids)], dtype=bool)

    def _units(self, ids: np.ndarray) -> list[_Piece]:
        """Whole units ``ids`` as pieces without a destination."""
        found = []
        for g, item, flat in self.units.locate(ids):
            found += self._pieces(g.asset, item, g.name, g.unit_region(item, flat), None)
        return found

    # statistics -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Hits, misses, bytes decoded, evictions, entries and bytes held, budget, regime."""
        if self.entries is not None:
            return {**self.entries.stats(), "regime": "in RAM (whole arrays)"}
        found = self.arena.stats()
        lookups = found["hits"] + found["misses"]
        return {
            **found,
            "hit_rate": found["hits"] / lookups if lookups else 0.0,
            "regime": f"out of core ({self.unit_bytes / 2**20:.2f} MiB units)",
        }

    def clear(self) -> None:
        """Empty the cache for every process (its statistics too)."""
        (self.entries or self.arena).clear()

    def close(self) -> None:
        """Release this process's hold on the cache; an unused cache can then be swept."""
        (self.entries or self.arena).close()


@dataclass
class _Handles:
    """What one process opens to read: the store, its copy threads (and how many), the
    stored arrays it keeps open, and the unit keys and entry keys it worked out."""

    store: ZarrStore | None = None
    pool: tuple[int, ThreadPoolExecutor] | None = None
    arrays: dict[tuple[str, int, str], ChunkedArray] = field(default_factory=dict)
    bases: dict[tuple[str, int, str], tuple[int, int]] = field(default_factory=dict)
    keys: dict[tuple[str, int, str], str] = field(default_factory=dict)


class _Piece(NamedTuple):
    """The part of one cached unit that one request needs."""

    key: tuple[int, int]
    asset: str
    item: int
    name: str
    coords: tuple[int, ...]
    dtype: np.dtype
    unit: tuple[int, ...]
    src: tuple[slice, ...]  # within the unit
    dst: np.ndarray | None  # the destination's part
    region: tuple[slice, ...]  # within the array


def _copy_regions(copies: Sequence[tuple[torch.Tensor, Region, np.ndarray]]) -> None:
    for whole, region, out in copies:
        torch.from_numpy(out).copy_(whole[region])


def copy_threads() -> int:
    """Threads this process may copy a batch on: every usable core in the main process, and
    a DataLoader worker's share of them (its siblings copy side by side)."""
    info = get_worker_info()
    cores = usable_cpus()
    return cores if info is None else max(1, cores // info.num_workers)
