"""What building one partition of a stage takes: the :class:`Step` a stage's builder returns,
and the :class:`Inputs` it builds from.

A builder is a plain function ``(inputs, key) -> Step``: it finds the raw item or the upstream
partitions it reads through :class:`Inputs`, and says how to produce the partition's arrays,
how to check them and what to report.  The one routine that fingerprints, reuses, checks and
commits (``zarrfeed.assets.build.build_partition``) does the rest the same way for every
family; nothing here imports Dagster.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from zarrfeed.errors import InputError, StoreError
from zarrfeed.sources.catalog import RawCatalog, RawItem
from zarrfeed.sources.raw import (
    SourceWatch,
    is_hub,
    item_sha256,
    source_identity,
    source_links,
)
from zarrfeed.store import ZarrStore
from zarrfeed.store.checksums import recorded_checksums
from zarrfeed.store.contract import CONTENT, SOURCE, StoredAsset, failed_checks, identity

if TYPE_CHECKING:
    from zarrfeed.families.family import Family

Checks = dict[str, tuple[bool, dict[str, Any]]]  # check name -> (passed, facts)


@dataclass
class Step:
    """What a builder supplies to build one partition."""

    inputs: dict[str, Any]  # the fingerprint inputs the contract declares
    source: str  # provenance: where the data came from
    source_sha256: str | None
    produce: Callable[[], dict[str, np.ndarray]]
    check: Callable[[dict[str, np.ndarray]], Checks]
    describe: Callable[[dict[str, np.ndarray]], dict[str, Any]] = lambda arrays: {}
    attrs: dict[str, Any] = field(default_factory=dict)  # more provenance
    watch: SourceWatch | None = None  # the raw files produce reads, checked after reading


class Fetch(Protocol):
    """Where a raw item's bytes are on this machine: a local item is where it was found; a
    hub item is downloaded first (and may be dropped once its partition is committed)."""

    def local(self, item: RawItem) -> Path: ...

    def forget(self, path: Path) -> None: ...


class LocalFetch:
    """Raw items on a local or mounted disk."""

    def local(self, item: RawItem) -> Path:
        if is_hub(item):
            raise StoreError(f"{item.location}: a hub item, and no hub to download it from")
        return Path(item.location)

    def forget(self, path: Path) -> None:
        return None


class Inputs:
    """What a family's builders read: the store, the family's catalog and settings, the raw
    items.  One per Dagster step, shared by the threads that build its partitions: an
    upstream array read for one stage is read once for all the stages of the step (each
    thread keeps the arrays of the last partition it read).

    Upstream arrays are read at the version the stage's fingerprint names and checked
    against the content checksums that version recorded, hashing the decoded values once
    as they are read (XXH3, ~24 GB/s): no stage builds on bytes that changed behind the
    store's back (a chunk that still decodes to other values)."""

    def __init__(
        self,
        family: Family,
        store: ZarrStore,
        catalog: RawCatalog,
        settings: Mapping[str, Any],
        fetch: Fetch | None = None,
    ) -> None:
        self.family, self.store, self.catalog, self.settings = family, store, catalog, settings
        self.fetch = fetch or LocalFetch()
        self._fetched: dict[str, Path] = {}  # key -> where its raw item was fetched to
        self._read = threading.local()  # per building thread: (path, key), its arrays

    def item(self, key: str) -> RawItem:
        """The catalog entry of partition ``key``; one-line failures for a missing source or
        a key that two raw items claim."""
        item = self.catalog.require(key)
        if item.conflict:
            raise InputError(
                item.location,
                f"a raw item of its own for partition key {key!r}",
                "the same key for " + ", ".join(item.conflict) + " (rename one of them)",
            )
        return item

    def files(self, item: RawItem) -> list[Path]:
        """The local files ``item`` reads (none for a hub item: its commit pins its bytes)."""
        return [] if is_hub(item) else self.family.raw.files(item)

    def content_hash(self, item: RawItem) -> str:
        """The item's content hash: recorded (hub listings, an earlier ingest of the same
        bytes) or computed now and recorded."""
        if item.content_hash:
            return item.content_hash
        if is_hub(item):
            raise StoreError(f"{item.location}: the hub listing gave no LFS hash for this file")
        return self.catalog.record_hash(item, item_sha256(item, self.files(item))).sha256 or ""

    def source(self, key: str) -> tuple[RawItem, str, dict[str, Any]]:
        """(item, content hash, fingerprint inputs) of a first-stage partition.  An item that
        fails raw ingest's blocking check (judged again here, the same rule, so that no run
        — batched or not — builds on it) fails naming its file."""
        item = self.item(key)
        _, readable, facts = self.family.raw.describe(item)
        if not readable:
            check = self.family.raw.readable
            raise InputError(
                item.location,
                f"an item that passes the {check.name!r} check ({check.description})",
                ", ".join(f"{k} {v}" for k, v in facts.items()) or "one that fails it",
            )
        sha = self.content_hash(item)
        return item, sha, {SOURCE: source_identity(item, sha)}

    def links(self, item: RawItem) -> dict[str, dict[str, Any]]:
        """The item's symlinks, each with its target and the target's hash, for the
        provenance (:func:`zarrfeed.sources.raw.source_links`: one the raw folder's policy
        refuses fails naming link and target)."""
        return source_links(item, self.files(item))

    def watch(self, item: RawItem) -> SourceWatch:
        """The item's files as they are now: :meth:`SourceWatch.verify` names one that changes
        while the build reads it."""
        return SourceWatch(item, self.files(item))

    def local(self, item: RawItem) -> Path:
        """Where the item's bytes are on this machine (a hub item is downloaded)."""
        path = self.fetch.local(item)
        if is_hub(item):
            self._fetched[item.key] = path
        return path

    def fingerprint(self, spec: StoredAsset, key: str) -> str:
        """The identity (fingerprint and content digest, ``contract.identity``) of partition
        ``key`` of upstream ``spec``: an input of the next stage, which then reads that
        version of it.  Building on a missing partition, or one that failed its checks,
        fails naming it."""
        if not self.store.has_partition(spec.path, key):
            raise StoreError(f"{spec.name}[{key}] is not built: materialise it first")
        record = self.store.commit_record(spec.path, key)
        failed = failed_checks(record)
        if failed:
            raise StoreError(
                f"{spec.name}[{key}] failed its checks ({', '.join(failed)}): fix its source; "
                "nothing is built on it"
            )
        pinned = getattr(self._read, "pinned", None)
        if pinned is None:
            pinned = self._read.pinned = {}
        pinned[spec.path] = record  # one per upstream asset: the partition being built
        return identity(record["attrs"]["fingerprint"], record["attrs"].get(CONTENT))

    def upstream(self, key: str, *specs: StoredAsset) -> dict[str, str]:
        """The fingerprint inputs of a partition built from ``specs``' partitions ``key``."""
        return {spec.name: self.fingerprint(spec, key) for spec in specs}

    def read(self, spec: StoredAsset, key: str, name: str) -> np.ndarray:
        """Array ``name`` of partition ``key`` of ``spec``, read once for the step's stages
        (each thread keeps the arrays of the last partition it read), at the version
        :meth:`fingerprint` named, and verified against its recorded checksum: a mismatch
        fails naming the partition, version and array."""
        cache = self._read
        record = (getattr(cache, "pinned", None) or {}).get(spec.path)
        if record is None or record["key"] != key:
            record = self.store.commit_record(spec.path, key)
        at = (spec.path, key, record["version"])
        if getattr(cache, "partition", None) != at:
            cache.partition, cache.arrays = at, {}
        if name not in cache.arrays:
            data = self.store.read_array(spec.path, key, name, record["version"])
            sums, checksum = recorded_checksums(record["attrs"])
            if name in sums and checksum(data) != sums[name]:
                where = f"{self.store.version_path(spec.path, key, record['version'])}/{name}"
                raise StoreError(
                    f"{spec.name}[{key}] array {name!r} ({where}): its content differs from "
                    "the checksum recorded when it was built (a chunk changed or lost behind "
                    f"the store's back); nothing is built on it: build {spec.name} again "
                    "(a plain build rebuilds it)"
                )
            cache.arrays[name] = data
        return cache.arrays[name]

    def shape(self, spec: StoredAsset, key: str, name: str) -> tuple[int, ...]:
        """The committed shape of an array (no data read)."""
        return tuple(self.store.commit_record(spec.path, key)["arrays"][name]["shape"])

    def done(self, key: str) -> None:
        """Partition ``key`` is committed: the raw item downloaded for it may go."""
        path = self._fetched.pop(key, None)
        if path is not None:
            self.fetch.forget(path)
