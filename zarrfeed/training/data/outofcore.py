"""The dataset does not fit its budget: the unit of caching is the stored chunk (or a
chunk-aligned block of small chunks, :mod:`~zarrfeed.training.data.units`), held in a
:class:`~zarrfeed.training.data.arena.ChunkArena` of exactly the budget.  A read decodes only
the units it overlaps that are not resident; each unit's 128-bit key is a digest of its
array's entry key and the unit shape, plus the unit's position."""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from zarrfeed.store import ZarrStore
from zarrfeed.training.data.arena import MASK, ChunkArena
from zarrfeed.training.data.reader import CachedArrays, Request
from zarrfeed.training.data.shm import CacheFolder
from zarrfeed.training.data.units import Region, UnitIndex, clip

log = logging.getLogger("zarrfeed.training")

MIN_SLOTS = 16  # an arena with fewer slots than this would thrash: read directly instead
ROUNDS = 4  # attempts to read a unit through the arena before decoding it privately
PREFETCH_BATCH = 4  # units claimed, decoded and published together ahead of the readers


class OutOfCoreArrays(CachedArrays):
    """Units of the stored arrays in a shared arena; with fewer than :data:`MIN_SLOTS`
    slots, arrays are read from the store without caching."""

    in_ram = False

    def __init__(self, store: ZarrStore, units: UnitIndex, budget_bytes: int) -> None:
        super().__init__(store, units, budget_bytes)
        digest = hashlib.sha256(
            f"{self.arrays}|{self.budget_bytes}|{self.unit_bytes}".encode()
        ).hexdigest()[:16]
        folder = CacheFolder("chunks", digest, self.meta | {"budget_bytes": self.budget_bytes})
        self.arena = ChunkArena(folder, self.budget_bytes, self.unit_bytes)
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

    @property
    def tier(self) -> ChunkArena:
        return self.arena

    @property
    def capacity_bytes(self) -> int:
        return self.arena.capacity_bytes if self.arena.slots >= MIN_SLOTS else 0

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

    def preload(self) -> None:
        """Nothing: units are decoded as they are read or prefetched."""

    def array(self, asset: str, item: int, name: str) -> np.ndarray:
        """All of an array, as a private array."""
        g = self.groups[asset, name]
        out = np.empty(tuple(int(n) for n in g.shapes[item]), g.dtype)
        self.read_into([(asset, item, name, tuple(slice(0, n) for n in out.shape), out)])
        return out

    def read_into(self, requests: Sequence[Request], threads: int = 1) -> None:
        """Copy each request's region into its destination, on up to ``threads`` threads.
        What a batch costs besides its copies is paid once per batch, not per patch: the
        pieces of the units each region overlaps are worked out in one pass and copied out
        of the arena under one seqlock check."""
        if not requests:
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
        if self.store.local or self.store.tier is None:
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

    def stats(self) -> dict[str, Any]:
        found = self.arena.stats()
        lookups = found["hits"] + found["misses"]
        return {
            **found,
            "hit_rate": found["hits"] / lookups if lookups else 0.0,
            "regime": f"out of core ({self.unit_bytes / 2**20:.2f} MiB units)",
        }


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
