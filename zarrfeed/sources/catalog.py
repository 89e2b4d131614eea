"""The raw-item catalog: every raw item recorded once, looked up in O(1), updated by diffs.

Discovery (a sensor tick, the hub listing) hands in what one *origin* holds now — a raw folder,
or a hub repository split — and :meth:`RawCatalog.update` writes only what changed: one small
object per new or changed item, and a compact index of the whole family that the next tick
diffs against.  A partition run reads its own item's object (:meth:`RawCatalog.get`), never
the raw tree; a nightly evaluation reads the index once.  Both live in the store's backend
(``.zarrfeed/catalog/<family>/``), so every process that sees the store — sensors, workers on
other machines — sees the same catalog.

An item's *stamp* (location, size, mtime, evidence) says whether it changed without reading
it.  Its content hash is recorded in its own object by the raw-ingest step (or given by the
hub) against the stamp it was computed for, so a hash never describes bytes that have changed
since; builds copy the stamp into each partition's provenance, which is how a nightly
evaluation tells a changed source from the index alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any

from zarrfeed.errors import StoreError
from zarrfeed.store import jsonio
from zarrfeed.store.backends import Backend
from zarrfeed.store.keys import check_asset, check_key
from zarrfeed.store.layout import catalog_path

# Store identity + index path → (the index object's size and change stamp, its items): a
# sensor's code server re-reads an index of 50,000 items every tick, mostly unchanged.
_PARSED: dict[str, tuple[tuple[int, str], dict[str, RawItem]]] = {}


@dataclass(frozen=True)
class RawItem:
    """One raw item: what reads it, where it is, what it looked like when last seen."""

    key: str
    kind: str  # the reader: nifti, dicom, npy, npz, spike, images …
    location: str  # a local path, or hf://datasets/<repo>@<commit>/<path>
    origin: str  # which discovery owns it: "raw:<folder>", "hub:<repo>:<split>"
    size: int
    mtime: float
    evidence: dict[str, Any] = field(default_factory=dict)  # small facts that shape the build
    detail: dict[str, Any] = field(default_factory=dict)  # reader facts (files of a series …)
    sha256: str | None = None  # content hash, valid for the stamp it was recorded with
    hashed_stamp: str | None = None
    conflict: tuple[str, ...] = ()  # other locations that claim this key

    @cached_property
    def stamp(self) -> str:
        """Changes whenever the item does (without reading it)."""
        facts = [self.location, self.size, self.mtime, self.evidence]
        return json.dumps(facts, sort_keys=True, default=str)

    def same_as(self, other: RawItem) -> bool:
        """Whether ``other`` has this item's stamp and conflicts (compared field by field:
        a discovery tick compares 50,000 items and need not serialise them)."""
        return (
            self.location == other.location
            and self.size == other.size
            and self.mtime == other.mtime
            and self.evidence == other.evidence
            and self.conflict == other.conflict
        )

    @property
    def content_hash(self) -> str | None:
        """The recorded hash if it still describes the item, else None (hash it again)."""
        return self.sha256 if self.hashed_stamp == self.stamp else None

    def to_json(self) -> dict[str, Any]:
        # Field by field: dataclasses.asdict deep-copies every value, 0.1 ms an item.
        return {f: getattr(self, f) for f in FIELDS} | {"conflict": list(self.conflict)}

    def to_index(self) -> dict[str, Any]:
        """The item without its reader facts: the index stays small at 50,000 items."""
        return {**self.to_json(), "detail": {}}

    @cached_property
    def index_row(self) -> str:
        """:meth:`to_index` as JSON, made once per item: a tick that changes 1,000 of
        50,000 items serialises 1,000."""
        return json.dumps(self.to_index())

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RawItem:
        return cls(**{**data, "conflict": tuple(data.get("conflict", ()))})


FIELDS = tuple(f.name for f in fields(RawItem))


def _vanished(item: RawItem) -> bool:
    """Whether a local item's file or folder is gone (one stat; hub items never vanish)."""
    return "://" not in item.location and not os.path.exists(item.location)


@dataclass(frozen=True)
class Changes:
    """What one discovery pass found, against the catalog."""

    new: list[str]
    changed: list[str]
    gone: list[str]
    conflicts: list[str]
    total: int

    def __bool__(self) -> bool:
        return bool(self.new or self.changed or self.gone)


class RawCatalog:
    """The catalog of one family (``ct``, ``spike``, ``images``) in a store's backend."""

    def __init__(self, backend: Backend, family: str) -> None:
        self.backend, self.family = backend, check_asset(family)
        self._folder = backend.join(catalog_path(family))
        self._index_path = f"{self._folder}/index.json"
        self._index: dict[str, RawItem] | None = None  # as this object last read or wrote it
        self._cache_key = f"{backend.identity}/{self._index_path}"

    def _item_path(self, key: str) -> str:
        return f"{self._folder}/items/{check_key(key)}.json"

    def get(self, key: str) -> RawItem | None:
        """The item of partition ``key`` (one small read), or None if it was never found."""
        try:
            return RawItem.from_json(jsonio.loads(self.backend.read(self._item_path(key))))
        except FileNotFoundError:
            return None

    def require(self, key: str) -> RawItem:
        """The item of ``key``, or an error naming what to do: a partition with no source
        fails in one line."""
        item = self.get(key)
        if item is None:
            raise StoreError(
                f"no raw {self.family} item {key!r} in the catalog of {self.backend.url}: it "
                f"was never discovered; remove the partition with `zarrfeed partitions remove "
                f"{self.family} {key}` or restore its source"
            )
        return item

    def index(self) -> dict[str, RawItem]:
        """Every item of the family: one read of the index, none right after :meth:`update`
        (a discovery tick diffs and then requests from the same index), and none when this
        process parsed the same index object before (its size and change stamp match)."""
        if self._index is None:
            stamp = self.backend.list_stamps(self._folder).get("index.json")
            cached = _PARSED.get(self._cache_key)
            if stamp is not None and cached is not None and cached[0] == stamp:
                self._index = cached[1]
            else:
                try:
                    rows = jsonio.loads(self.backend.read(self._index_path))
                except FileNotFoundError:
                    rows = []
                self._index = {r["key"]: RawItem.from_json(r) for r in rows}
                if stamp is not None:
                    _PARSED[self._cache_key] = (stamp, self._index)
        return dict(self._index)

    def skipped(self) -> dict[str, dict[str, str]]:
        """Origin → the broken entries its last discovery skipped (path → why)."""
        try:
            return jsonio.loads(self.backend.read(f"{self._folder}/skipped.json"))
        except FileNotFoundError:
            return {}

    def record_skipped(self, origin: str, skipped: Mapping[str, str]) -> None:
        """Keep what the discovery of ``origin`` skipped, for ``zarrfeed status``; written
        only when it changed (a tick that finds the same broken link writes nothing)."""
        before = self.skipped()
        after = {**before, origin: dict(sorted(skipped.items()))}
        if not skipped:
            del after[origin]
        if after != before:
            self.backend.write_atomic(f"{self._folder}/skipped.json", jsonio.dumps(after))

    def update(self, origin: str, found: Mapping[str, RawItem]) -> Changes:
        """Record what ``origin`` holds now: new and changed items are written, items of this
        origin no longer found are removed; items of other origins are kept.  A key claimed
        by two origins, or twice within one, is a conflict on both items, unless the other
        origin's item is gone from disk (its root moved or unmounted): the key then passes
        to the item found now, so a moved raw root keeps its keys without a conflict."""
        self._index = None  # diff against what is stored now
        index = self.index()
        before = {k: v for k, v in index.items() if v.origin == origin}
        new, changed, writes = [], [], {}
        for key, item in found.items():
            other = index.get(key)
            if other is not None and other.origin != origin and not _vanished(other):
                item = replace(item, conflict=tuple(sorted({*item.conflict, other.location})))
            old = before.get(key)
            if old is None:
                new.append(key)
            elif not old.same_as(item):
                changed.append(key)
            else:
                continue
            writes[key] = item
        gone = sorted(set(before) - set(found))
        for key in gone:
            self.backend.remove(self._item_path(key))
            del index[key]
        if writes:
            self.backend.put_many(
                f"{self._folder}/items",
                {f"{k}.json": json.dumps(v.to_json()).encode() for k, v in writes.items()},
            )
            index.update(writes)
        if writes or gone:
            self._write_index(index)
        self._index = index
        conflicts = sorted(k for k in found if writes.get(k, found[k]).conflict)
        return Changes(sorted(new), sorted(changed), gone, conflicts, len(found))

    def record_hash(self, item: RawItem, sha256: str) -> RawItem:
        """Remember the content hash computed for ``item`` as it was when hashed (its own
        object only: a partition run never rewrites the family's index)."""
        hashed = replace(item, sha256=sha256, hashed_stamp=item.stamp)
        current = self.get(item.key)
        if current is not None and current.stamp == item.stamp:
            data = json.dumps(hashed.to_json()).encode()
            self.backend.write_atomic(self._item_path(item.key), data)
        return hashed

    def _write_index(self, index: dict[str, RawItem]) -> None:
        rows = ",".join(index[k].index_row for k in sorted(index))
        self.backend.write_atomic(self._index_path, f"[{rows}]".encode())
        stamp = self.backend.list_stamps(self._folder).get("index.json")
        if stamp is not None:  # what this process wrote, it need not parse again
            _PARSED[self._cache_key] = (stamp, dict(index))
