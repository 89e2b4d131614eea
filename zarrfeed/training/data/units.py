"""The cache's unit of decoded data and its numbering: which units a dataset has, which ones
a sample reads, and where each one lies.

A unit is the stored chunk, grown along its leading axes to a chunk-aligned block of at least
:data:`MIN_UNIT` bytes (chunks of 64³ float16 are units as they are; small chunks are cached
in blocks, not one slot each).  Every unit of a dataset has a global id — array by array,
partition by partition, in C order within an array — so the block sampler can count and
prefetch what samples need with a few numpy arrays.  The tables are built from the dataset
manifest alone: no store access.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zarrfeed.errors import StoreError

MIN_UNIT = 256 << 10
Region = tuple[slice, ...]


def unit_shape(shape: Sequence[int], chunks: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The chunk grown along its leading axes (whole chunks, within the array) to at least
    :data:`MIN_UNIT` bytes."""
    unit = [max(1, int(c)) for c in chunks]
    for axis, n in enumerate(shape):
        have = int(np.prod(unit)) * itemsize
        if have >= MIN_UNIT:
            break
        grid = -(-max(1, int(n)) // unit[axis])
        unit[axis] *= min(grid, -(-MIN_UNIT // have))
    return tuple(unit)


def clip(region: Region, shape: Sequence[int]) -> Region:
    """``region`` as one ``slice(start, stop)`` per axis inside ``shape`` (steps of 1)."""
    out = []
    for s, n in zip(region, shape, strict=True):
        start, stop, step = s.indices(int(n))
        if step != 1 or stop < start:
            raise ValueError(f"region {region}: only contiguous slices are supported")
        out.append(slice(start, stop))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class ArrayGroup:
    """One cached array name of one asset over all its partitions (compact numpy tables)."""

    asset: str
    name: str
    keys: list[str]
    versions: list[str]
    dtype: np.dtype
    shapes: np.ndarray  # (partitions, ndim)
    units: np.ndarray  # (partitions, ndim) unit shape per partition
    offsets: np.ndarray  # global id of each partition's first unit, and the end

    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    def unit_region(self, item: int, flat: int) -> Region:
        """The part of the array that unit ``flat`` of partition ``item`` covers (unclipped)."""
        unit = self.units[item]
        coords = np.unravel_index(flat, tuple(int(n) for n in -(-self.shapes[item] // unit)))
        edges = zip(coords, unit, strict=True)
        return tuple(slice(int(c) * int(u), (int(c) + 1) * int(u)) for c, u in edges)


class UnitIndex:
    """The units of a dataset's cached arrays: ``sources`` maps each asset to its manifest
    partitions and the array names to cache."""

    def __init__(self, sources: dict[str, tuple[list[dict[str, Any]], list[str]]]) -> None:
        self.groups: dict[tuple[str, str], ArrayGroup] = {}
        first = 0
        for asset, (partitions, names) in sources.items():
            for name in names:
                group = _group(asset, name, partitions, first)
                self.groups[asset, name] = group
                first = int(group.offsets[-1])
        self.nbytes = sum(
            int(np.prod(g.shapes, axis=1).sum()) * g.dtype.itemsize for g in self.groups.values()
        )
        self.unit_bytes = max(
            int(np.prod(g.units, axis=1).max()) * g.dtype.itemsize for g in self.groups.values()
        )

    def unit_counts(self, asset: str, names: Sequence[str]) -> np.ndarray:
        """Units of each partition of ``asset`` over ``names`` (its whole working set)."""
        return sum(self.groups[asset, n].counts() for n in names)

    def region_units(
        self, asset: str, name: str, items: np.ndarray, starts: np.ndarray, size: Sequence[int]
    ) -> np.ndarray:
        """Global ids of the units that regions ``starts[i] : starts[i] + size`` of partitions
        ``items[i]`` overlap."""
        g = self.groups[asset, name]
        units, shapes = g.units[items], g.shapes[items]
        grid = -(-shapes // units)
        lo = starts // units
        hi = (np.minimum(starts + np.asarray(size), shapes) - 1) // units
        ids = []
        for step in itertools.product(*(range(int(m) + 1) for m in (hi - lo).max(axis=0))):
            coords = lo + np.asarray(step)
            ok = (coords <= hi).all(axis=1)
            flat = np.zeros(len(items), np.int64)
            for axis in range(coords.shape[1]):
                flat = flat * grid[:, axis] + coords[:, axis]
            ids.append((g.offsets[items] + flat)[ok])
        return np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)

    def whole_units(self, asset: str, names: Sequence[str], items: np.ndarray) -> np.ndarray:
        """Global ids of every unit of ``names`` of partitions ``items``."""
        ids = []
        for n in names:
            offsets = self.groups[asset, n].offsets
            ids += [np.arange(offsets[i], offsets[i + 1]) for i in np.unique(items)]
        return np.concatenate(ids) if ids else np.zeros(0, np.int64)

    def locate(self, ids: np.ndarray) -> Iterable[tuple[ArrayGroup, int, int]]:
        """(group, partition, unit index within the array) of each global unit id."""
        for g in self.groups.values():
            mine = ids[(ids >= g.offsets[0]) & (ids < g.offsets[-1])]
            items = np.searchsorted(g.offsets, mine, side="right") - 1
            for unit_id, item in zip(mine.tolist(), items.tolist(), strict=True):
                yield g, item, unit_id - int(g.offsets[item])


def _group(asset: str, name: str, partitions: list[dict[str, Any]], first: int) -> ArrayGroup:
    if not partitions:
        raise StoreError(f"no partitions of {asset} to read")
    arrays = [p["arrays"].get(name) for p in partitions]
    if missing := [p["key"] for p, a in zip(partitions, arrays, strict=True) if a is None]:
        raise StoreError(f"partitions {missing[:3]} of {asset} have no array {name!r}")
    dtype = np.dtype(arrays[0]["dtype"])
    shapes = np.array([a["shape"] for a in arrays], dtype=np.int64).reshape(len(arrays), -1)
    chunks = [a.get("chunks") or a["shape"] for a in arrays]
    units = [unit_shape(s, c, dtype.itemsize) for s, c in zip(shapes, chunks, strict=True)]
    units = np.array(units, dtype=np.int64).reshape(shapes.shape)
    counts = np.prod(-(-shapes // units), axis=1)
    offsets = first + np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    keys, versions = [p["key"] for p in partitions], [p["version"] for p in partitions]
    return ArrayGroup(asset, name, keys, versions, dtype, shapes, units, offsets)
