"""The Zarr store: one group per asset, immutable versions per partition, one-write commits.

Layout under the root (a local folder or an fsspec URL such as ``s3://bucket/prefix``)::

    zarr.json                                  root group (attribute zarrfeed_layout = 2)
    <asset>/<key>/<version>/zarr.json          a version of a partition; attributes = provenance
    <asset>/<key>/<version>/<array>/...        its arrays
    .zarrfeed/commits/<asset>/<key>.json       the commit record: names the committed version
    .zarrfeed/manifests/<name>.json            dataset manifests training consumes

(``zarrfeed.store.layout`` names every path outside the asset groups.)

A partition is written into a fresh version folder that nothing points at, then published by
one atomic write of its commit record (a rename of a temporary file on a disk, one PUT on an
object store); readers resolve a partition through its record and list partitions by their
records.  A crash at any instant therefore leaves the old commit or the new one, each with all
its data, and nothing is ever copied after it is written.  The version a record replaces is
removed after the record is published — its ``zarr.json`` first (the *guard*), so a reader
still holding it fails loudly rather than reading missing chunks as fill values.  Versions no
record names (writers that crashed) are removed once older than :data:`VERSION_GRACE_S`: on
the next commit of the same partition, or by :meth:`ZarrStore.collect_garbage` for the whole
store.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype
from zarr.storage import StorePath

import zarrfeed
from zarrfeed.errors import StoreError, ZarrfeedError
from zarrfeed.store import jsonio
from zarrfeed.store.backends import TEMPORARY, Backend, LocalBackend, open_backend
from zarrfeed.store.bulk import gc_paused
from zarrfeed.store.changes import DELETED, MARGIN_S, ChangeLog, ChangeLogError, Intent, now_ns
from zarrfeed.store.chunkio import ChunkedArray, write_from
from zarrfeed.store.codecs import Content, Read, chunks_for, compressors_for
from zarrfeed.store.contract import (
    CONTENT,
    UPSTREAM,
    StoredAsset,
    changed_settings,
    failed_checks,
    mixed_builds,
    mixed_settings,
)
from zarrfeed.store.disktier import DiskTier, open_tier
from zarrfeed.store.keys import check_asset, check_key
from zarrfeed.store.layout import META, dataset_path, manifest_path, snapshot_path
from zarrfeed.store.leases import Lease, live
from zarrfeed.store.rows import Rows, asset_summary
from zarrfeed.store.snapshots import Retention, Snapshots
from zarrfeed.store.stamps import PATTERN, match
from zarrfeed.store.stamps import stamp as new_stamp

LAYOUT = 2
# Change-log hours kept: a reader whose last look is older scans in full.
CHANGES_KEPT_S = 7 * 86400.0
# Of .zarrfeed/indexes/<asset>.json: {layout, position, partitions}; 3: summaries hold the
# params (the per-dataset settings' values, contract.mixed_settings), so older ones are read again.
INDEX_LAYOUT = 3
_log = logging.getLogger(__name__)
# A version no record names is a writer's work in progress until it is this old.
VERSION_GRACE_S = 3600.0
LISTINGS_KEPT = 4096  # version listings a store keeps (each a set of its object paths)
_VERSION = re.compile(rf"v({PATTERN})-[0-9a-f]{{8}}")


def new_version(now: float | None = None) -> str:
    """A unique, sortable version name that carries its creation time (object stores give
    folders no mtime): ``v20261123T180102123Z-3fa2b1c4``."""
    return f"v{new_stamp(now)}-{uuid.uuid4().hex[:8]}"


def version_time(name: str) -> float | None:
    """Creation time of a version name; None for anything that is not one."""
    return match(_VERSION, name)


@dataclass
class Collection:
    """What :meth:`ZarrStore.collect` removed and kept."""

    removed: int = 0
    leases: int = 0  # live readers' leases
    retained_versions: int = 0  # superseded partition versions a dataset version still names
    kept: dict[str, str] = field(default_factory=dict)  # "<dataset>@<id>" -> why it is kept
    expired: list[str] = field(default_factory=list)  # dataset versions past retention

    def describe(self) -> str:
        kept = "; ".join(f"{k} ({why})" for k, why in self.kept.items()) or "none"
        return (
            f"removed {self.removed} objects ({len(self.expired)} dataset versions past "
            f"retention); kept {self.retained_versions} superseded partition versions for "
            f"dataset versions {kept}; {self.leases} live readers"
        )


class PartitionWriter:
    """Arrays of one partition version being written; committed by
    :meth:`ZarrStore.write_partition`."""

    def __init__(self, store: ZarrStore, folder: str, attrs: dict[str, Any]) -> None:
        self._store, self.folder = store, folder
        self._zstore = store.backend.zarr_store(folder, read_only=False)
        self.attrs: dict[str, Any] = dict(attrs)
        self.arrays: dict[str, zarr.Array] = {}
        # Blocking check results, recorded with the commit: datasets leave out failures.
        self.checks: dict[str, bool] = {}

    def create(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: np.dtype | str,
        read: Read = "patch",
        content: Content = "dense",
        chunks: tuple[int, ...] | None = None,
        fill_value: Any = 0,
        dimension_names: tuple[str, ...] | None = None,
    ) -> zarr.Array:
        """An empty array to fill slab by slab (for data larger than memory)."""
        check_key(name)
        auto_chunks, shards = chunks_for(shape, dtype, read)
        try:
            arr = zarr.create_array(
                self._zstore,
                name=name,
                shape=shape,
                dtype=dtype,
                chunks=chunks or auto_chunks,
                shards=None if chunks else shards,
                compressors=compressors_for(dtype, content),
                fill_value=fill_value,
                dimension_names=dimension_names,
            )
        except OSError as exc:  # the storage, not the arguments: name the object
            raise self._store.backend.failure("write", f"{self.folder}/{name}", exc) from None
        self.arrays[name] = arr
        return arr

    def write(self, name: str, data: np.ndarray, **kwargs: Any) -> zarr.Array:
        """Create array ``name`` and write ``data`` into it (chunks coded in threads)."""
        data = np.asarray(data)
        arr = self.create(name, data.shape, data.dtype, **kwargs)
        backend, folder = self._store.backend, f"{self.folder}/{name}"
        write_from(arr, data, lambda coded: backend.put_many(folder, coded))
        return arr

    def summary(self) -> dict[str, dict[str, Any]]:
        return {
            name: {
                "shape": list(a.shape),
                "dtype": str(a.dtype),
                "chunks": list(a.chunks),
                "shards": list(a.shards) if a.shards else None,
                "codec": a.compressors[0].to_dict() if a.compressors else None,
                "nbytes": int(a.nbytes),
                # The array's zarr.json as written: a reader opens the array from the record
                # it reads anyway, without a second round trip for the metadata.
                "zarr_json": zarr_json(a),
            }
            for name, a in self.arrays.items()
        }


class ZarrStore:
    """Committed partitions of every asset under one root URL or folder."""

    def __init__(self, url: str | Path, storage_options: dict[str, Any] | None = None) -> None:
        self.backend: Backend = open_backend(url, storage_options)
        self.root, self.url = self.backend.root, self.backend.url
        # What makes this store's bytes unique on this machine: a cache key starts with it.
        self.identity = self.backend.identity
        self.local = isinstance(self.backend, LocalBackend)
        # Chunks fetched from an object store are kept on the local disk (None: off).
        self.tier: DiskTier | None = None if self.local else open_tier()
        self._listings: dict[str, frozenset[str]] = {}  # version folder -> its objects
        self._groups: set[str] = set()
        self._changes: dict[str, ChangeLog] = {}
        self.snapshots = Snapshots(self.backend, self.url)

    def __repr__(self) -> str:
        return f"ZarrStore({self.url!r})"

    def exists(self) -> bool:
        """Whether anything was ever written here (a commit, a catalog): a command that only
        reads refuses a store that does not exist instead of reporting it empty."""
        return bool(self.backend.list_dir(self.root))

    # paths -------------------------------------------------------------------------------
    def path(self, asset: str, key: str | None = None) -> str:
        """The folder of an asset, or of one partition (all its versions)."""
        parts = [check_asset(asset)]
        if key is not None:
            parts.append(check_key(key))
        return self.backend.join(*parts)

    def version_path(self, asset: str, key: str, version: str | None = None) -> str:
        """The folder of a partition's committed version (or of ``version``)."""
        version = version or self.commit_record(asset, key)["version"]
        return f"{self.path(asset, key)}/{version}"

    def partition_url(self, asset: str, key: str) -> str:
        """A URL (or absolute path) of the committed version, to show to a person."""
        path = self.version_path(asset, key)
        return path if self.local else f"{self.url}{path[len(self.root) :]}"

    def manifest_url(self, name: str, version: str | None = None) -> str:
        """Where the manifest of version ``version`` of dataset ``name`` is (default: its
        current version), to show to a person."""
        version = version or (self.snapshots.pointer(check_asset(name)) or {}).get("id")
        return f"{self.url}/{snapshot_path(name, version) if version else manifest_path(name)}"

    def _meta(self, *parts: str) -> str:
        return self.backend.join(META, *parts)

    def _record_path(self, asset: str, key: str) -> str:
        return self._meta("commits", check_asset(asset), f"{check_key(key)}.json")

    # writing -----------------------------------------------------------------------------
    @contextmanager
    def write_partition(
        self, asset: str, key: str, attrs: dict[str, Any] | None = None
    ) -> Iterator[PartitionWriter]:
        """Write a new version of a partition; it is committed only when the ``with`` block
        ends cleanly.  An exception inside the block removes the new version and leaves the
        committed one untouched."""
        version = new_version()
        folder = f"{self.path(asset, key)}/{version}"
        writer = PartitionWriter(self, folder, attrs or {})
        try:
            yield writer
            record = self._finish(writer, asset, key, version)
        except BaseException:
            self._discard(folder)
            raise
        self._publish(asset, key, version, record)

    def _discard(self, folder: str) -> None:
        """Remove a version nothing names; if that fails too (the store is unreachable), the
        version stays for :meth:`collect_garbage` and the original error is what is raised."""
        with suppress(ZarrfeedError, OSError):
            self.remove_version(folder)

    def _finish(self, writer: PartitionWriter, asset: str, key: str, version: str) -> bytes:
        if not writer.arrays:
            raise StoreError(f"partition {asset}/{key} has no arrays; nothing to commit")
        try:
            zarr.open_group(writer._zstore, mode="r+").attrs.update(writer.attrs)
        except OSError as exc:
            raise self.backend.failure("write", f"{writer.folder}/zarr.json", exc) from None
        _young_enough(asset, key, version)
        now = time.time()
        record = {
            "layout": LAYOUT,
            "asset": asset,
            "key": key,
            "version": version,
            "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "committed_unix": now,
            "zarrfeed_version": zarrfeed.__version__,
            "arrays": writer.summary(),
            "stored_bytes": self.backend.tree_bytes(writer.folder),
            "attrs": writer.attrs,
            "checks": dict(writer.checks),
        }
        return json.dumps(record, default=_json_default).encode()

    def _publish(self, asset: str, key: str, version: str, record: bytes) -> None:
        """One atomic write of the record commits ``version``; then the version it replaced
        goes.  A write whose outcome is unknown (the connection broke after the request was
        sent) is settled by reading the record back: committed, or the new version is
        removed, or — when even that read fails — left for :meth:`collect_garbage`."""
        folder = f"{self.path(asset, key)}/{version}"
        try:
            self._ensure_groups(asset, key)
            self.backend.persist(folder)  # the data is durable before the record names it
            noted = self.changes(asset).note(key, version)  # readers look at this key again
            _young_enough(asset, key, version)  # again: making it durable takes time too
        except BaseException:
            self._discard(folder)
            raise
        try:
            self.backend.write_atomic(self._record_path(asset, key), record)  # the commit
        except BaseException:
            if not self._settle(asset, key, version):
                raise
        if now_ns() - noted > MARGIN_S / 2 * 1e9:  # landed late: readers may have moved on
            self.changes(asset).note(key, version)
        # Committed.  The version it replaced stays: a dataset version or a live reader may
        # name it, and collect_garbage removes it once nothing does.

    def _settle(self, asset: str, key: str, version: str) -> bool:
        """Whether a record write that raised committed ``version`` after all; the version
        is removed when it surely did not, and kept when the record cannot be read."""
        try:
            committed = self._committed_version(asset, key) == version
        except (ZarrfeedError, OSError):
            return False
        if not committed:
            self._discard(f"{self.path(asset, key)}/{version}")
        return committed

    def _committed_version(self, asset: str, key: str) -> str | None:
        path = self._record_path(asset, key)
        try:
            data = self.backend.read(path)
        except FileNotFoundError:
            return None
        return jsonio.named(path, data).get("version")

    def _ensure_groups(self, asset: str, key: str) -> None:
        """Group metadata for the root, each asset level and the partition folder, so the
        hierarchy is browsable with any Zarr tool."""
        parts = [*asset.split("/"), key]
        root_store = self.backend.zarr_store(self.root, read_only=False)
        for i in range(len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub in self._groups:
                continue
            meta = self.backend.join(sub, "zarr.json") if sub else self.backend.join("zarr.json")
            if not self.backend.exists(meta):
                attrs = {} if sub else {"zarrfeed_layout": LAYOUT}
                # Writers of other partitions create the same groups: the first one wins.
                with suppress(zarr.errors.ContainsGroupError):
                    zarr.open_group(root_store, path=sub, mode="a", attributes=attrs)
            self._groups.add(sub)

    def remove_version(self, folder: str) -> None:
        """Remove one version folder, its guard first (see the module docstring)."""
        self.backend.remove(f"{folder}/zarr.json")
        self.backend.remove_tree(folder)

    def delete_partition(self, asset: str, key: str) -> None:
        """Un-commit a partition; its versions stay while a dataset version or a live reader
        names them, and :meth:`collect_garbage` removes them after."""
        self.changes(asset).note(key, DELETED)
        self.backend.remove(self._record_path(asset, key))

    def collect_garbage(self, older_than_s: float = VERSION_GRACE_S) -> int:
        """:meth:`collect`, returning how many objects it removed."""
        return self.collect(older_than_s).removed

    def collect(self, older_than_s: float = VERSION_GRACE_S) -> Collection:
        """Remove what nothing retains: versions no commit record, retained dataset version
        or live reader's lease names, older than ``older_than_s`` (a writer at work is
        younger); dataset versions past their retention; change-log hours older than
        :data:`CHANGES_KEPT_S`; temporaries of dead writers.  Returns what it removed and
        what it kept, and why."""
        now = time.time()
        leases = live(self.backend, now)
        leased = {(lease["dataset"], lease["snapshot"]) for lease in leases}
        report = Collection(leases=len(leases))
        protected: dict[str, set[str]] = {}
        window = min(older_than_s, MARGIN_S)
        for name in self.snapshots.datasets():
            mine = {s for d, s in leased if d == name}
            why, expired = self.snapshots.retained(name, now, mine, window)
            for snapshot in expired:
                self.snapshots.remove(name, snapshot)
                report.removed += 1
                report.expired.append(f"{name}@{snapshot}")
            for snapshot, reason in why.items():
                try:
                    manifest = self.snapshots.read(name, snapshot)
                except StoreError:
                    continue  # removed meanwhile by another collector
                report.kept[f"{name}@{snapshot}"] = reason
                for path, versions in pinned_versions(manifest).items():
                    protected.setdefault(path, set()).update(versions)
        for asset, keys in self._version_folders():
            committed = {k: s["version"] for k, s in self.record_summaries(asset).items()}
            keep = protected.get(asset, set())
            for key, names in keys.items():
                gone = [
                    n for n in names
                    if n != committed.get(key) and n not in keep
                    and now - (version_time(n) or now) >= older_than_s
                ]  # fmt: skip
                if gone and self._committed_version(asset, key) in gone:
                    gone.remove(self._committed_version(asset, key))  # committed meanwhile
                for name in gone:
                    self.remove_version(f"{self.path(asset, key)}/{name}")
                report.removed += len(gone)
                report.retained_versions += sum(
                    1 for n in names if n in keep and n != committed.get(key)
                )
        cutoff = now_ns() - int(CHANGES_KEPT_S * 1e9)
        for asset in self._logged_assets():
            report.removed += self.changes(asset).compact(cutoff)
        report.removed += self._collect_temporaries(self._meta(), older_than_s)
        return report

    def _logged_assets(self, prefix: str = "") -> Iterator[str]:
        """Every asset with a change log."""
        folder = self._meta("changes", prefix) if prefix else self._meta("changes")
        names = self.backend.list_dir(folder)
        if prefix and any(n == "start.json" or n.isdigit() for n in names):
            yield prefix
            return
        for name in names:
            yield from self._logged_assets(f"{prefix}/{name}" if prefix else name)

    def _collect_temporaries(self, folder: str, older_than_s: float) -> int:
        """Record files a local writer died while publishing (``<name>.<unix>-<id>.tmp``)."""
        removed, now = 0, time.time()
        for name in self.backend.list_dir(folder):
            path = f"{folder}/{name}"
            if not name.endswith(TEMPORARY):
                if "." not in name:
                    removed += self._collect_temporaries(path, older_than_s)
                continue
            stamp = name[: -len(TEMPORARY)].rsplit(".", 1)[-1].split("-", 1)[0]
            if stamp.isdigit() and now - int(stamp) >= older_than_s:
                self.backend.remove(path)
                removed += 1
        return removed

    def _version_folders(self, prefix: str = "") -> Iterator[tuple[str, dict[str, list[str]]]]:
        """(asset, key → its version names) of every asset with versions, committed or not."""
        folder = self.backend.join(prefix) if prefix else self.root
        found: dict[str, list[str]] = {}
        for name in self.backend.list_dir(folder):
            if name in (META, "zarr.json") or version_time(name) is not None:
                continue
            sub = f"{prefix}/{name}" if prefix else name
            children = self.backend.list_dir(self.backend.join(sub))
            versions = [c for c in children if version_time(c) is not None]
            if versions and prefix:
                found[name] = versions
            elif children:
                yield from self._version_folders(sub)
        if found:
            yield prefix, found

    # reading -----------------------------------------------------------------------------
    def list_partitions(self, asset: str) -> list[str]:
        """Keys of the committed partitions of ``asset``, sorted."""
        names = self.backend.list_dir(self._meta("commits", check_asset(asset)))
        return sorted(n[: -len(".json")] for n in names if n.endswith(".json"))

    def has_partition(self, asset: str, key: str) -> bool:
        return self.backend.exists(self._record_path(asset, key))

    def commit_record(self, asset: str, key: str) -> dict[str, Any]:
        """The commit record of a partition: its version, arrays, stored bytes, provenance."""
        path = self._record_path(asset, key)
        try:
            data = self.backend.read(path)
        except FileNotFoundError:
            raise StoreError(f"no committed partition {key!r} of {asset!r} in {self.url}") from None
        record = jsonio.named(path, data)
        if "version" not in record:
            raise StoreError(
                f"partition {asset}/{key} of {self.url} was written by an older zarrfeed "
                "(store layout 1): rebuild the store into a new folder"
            )
        return record

    def commit_records(self, asset: str, keys: list[str]) -> dict[str, dict[str, Any] | None]:
        """Commit records of many partitions at once (None where one is not committed): one
        concurrent read instead of a round trip per key on an object store."""
        paths = [self._record_path(asset, k) for k in keys]
        found = self.backend.read_many(paths)
        return {
            k: None if b is None else jsonio.named(p, b)
            for k, p, b in zip(keys, paths, found, strict=True)
        }

    def changes(self, asset: str) -> ChangeLog:
        """The change log of ``asset``: one intent per commit, written before its record."""
        check_asset(asset)
        if asset not in self._changes:
            self._changes[asset] = ChangeLog(self.backend, asset)
        return self._changes[asset]

    def record_summaries(self, asset: str) -> dict[str, dict[str, Any]]:
        """Committed key → the summary of its commit record that manifests and the nightly
        evaluation use (:func:`summarise`), for every committed partition of ``asset``.

        Proportional to what changed: the summaries are kept in
        ``.zarrfeed/indexes/<asset>.json`` with the time they were looked at, and the next
        caller reads only the records the asset's change log names since then
        (:mod:`zarrfeed.store.changes`).  Without a usable log (none, unreadable, or
        compacted past that time) it scans in full — one listing of the records with their
        change stamps, then only the records new or changed since the index read — and logs
        why when the log should have served.  Either way the records are the truth, so a
        stale or lost index or log costs reads, never a wrong answer.
        """
        return self._summaries(asset)[0]

    @gc_paused()  # 50,000 summaries, none of them garbage
    def _summaries(self, asset: str) -> tuple[dict[str, dict[str, Any]], int | None]:
        """:meth:`record_summaries`, and where the change log is to be read from next."""
        path = self._meta("indexes", f"{check_asset(asset)}.json")
        try:
            index: dict[str, Any] = jsonio.loads(self.backend.read(path))
        except (FileNotFoundError, ValueError):
            index = {}
        if index.get("layout") != INDEX_LAYOUT:
            index = {}
        cached: dict[str, Any] = index.get("partitions", {})
        position: int | None = index.get("position")
        looked = now_ns()
        intents = self._covered(asset, position, looked, known=bool(index))
        if intents is not None:
            out, fresh = self._apply(asset, cached, intents)
        else:
            out, fresh = self._scan(asset, cached)
            intents = self._recent(asset, looked)
        after = None if intents is None else _next_position(looked, intents, out)
        if fresh or len(out) != len(cached) or after != position:
            state = {"layout": INDEX_LAYOUT, "position": after, "partitions": out}
            with suppress(ZarrfeedError, OSError):  # a cache: the next caller re-reads
                self.backend.write_atomic(path, jsonio.dumps(state, default=_json_default))
        return out, after

    def _covered(
        self, asset: str, position: int | None, looked: int, known: bool
    ) -> list[Intent] | None:
        """The intents of ``asset`` from ``position`` on; None when the log does not cover
        them all (logged when ``known``: a reader had looked at it before)."""
        log = self.changes(asset)
        try:
            start = log.start()
            if start is None:
                if known:
                    _log.warning("%s has no change log for %s: reading every record's stamp",
                                 self.url, asset)  # fmt: skip
                log.begin(looked)  # complete from now on: writers note every commit
                return None
            if position is None or position < start:
                return None
            return log.since(position)
        except ChangeLogError as exc:
            _log.warning("%s: the change log of %s is unusable (%s): reading every record's "
                         "stamp", self.url, asset, exc)  # fmt: skip
            return None

    def _recent(self, asset: str, looked: int) -> list[Intent] | None:
        """The intents of ``asset`` younger than the version grace (commits perhaps still
        landing); None when the log is unusable."""
        log = self.changes(asset)
        try:
            start = log.start()
            return log.since(max(start or looked, looked - int(VERSION_GRACE_S * 1e9)))
        except ChangeLogError:
            return None

    def _apply(
        self, asset: str, cached: dict[str, Any], intents: list[Intent]
    ) -> tuple[dict[str, Any], int]:
        """``cached`` with the records of the keys ``intents`` name read again."""
        keys = sorted({i.key for i in intents})
        fresh = self.commit_records(asset, keys)
        out = dict(cached)
        for key, record in fresh.items():
            if record is None:
                out.pop(key, None)
            else:
                out[key] = {**summarise(record), "stamp": None}
        return dict(sorted(out.items())), len(fresh)

    def _scan(self, asset: str, cached: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Summaries from one listing of the records with their change stamps, reading
        only those not in ``cached`` with the same stamp."""
        folder = self._meta("commits", check_asset(asset))
        listed = {
            name[: -len(".json")]: list(stamp)
            for name, stamp in self.backend.list_stamps(folder).items()
            if name.endswith(".json")
        }
        stale = [k for k, stamp in listed.items() if cached.get(k, {}).get("stamp") != stamp]
        fresh = self.commit_records(asset, stale)
        out = {}
        for key, stamp in sorted(listed.items()):
            if key not in fresh:
                out[key] = cached[key]
            elif fresh[key] is not None:  # else un-committed between the listing and the read
                out[key] = {**summarise(fresh[key]), "stamp": stamp}
        return out, len(stale)

    def open_partition(self, asset: str, key: str, version: str | None = None) -> zarr.Group:
        """The read-only Zarr group of the committed version of a partition, or of
        ``version`` (a reader pinned to what a manifest listed)."""
        folder = self.version_path(asset, key, version)
        if version is not None and not self.backend.exists(f"{folder}/zarr.json"):
            raise StoreError(
                f"version {version} of partition {asset}/{key} is gone from {self.url}: it was "
                "rebuilt or deleted and then collected, as no retained dataset version or live "
                "reader named it"
            )
        return zarr.open_group(self.backend.zarr_store(folder, read_only=True), mode="r")

    def open_array(self, asset: str, key: str, name: str, version: str | None = None) -> zarr.Array:
        """Array ``name`` of the committed version of a partition (or of ``version``).

        The array's own metadata is the only object read besides the commit record — one
        round trip each on an object store; the group is looked at only to explain a miss.
        """
        folder = self.version_path(asset, key, version)
        zstore = self.backend.zarr_store(folder, read_only=True)
        try:
            return zarr.open_array(zstore, path=check_key(name), mode="r", zarr_format=3)
        except FileNotFoundError:  # zarr's NodeNotFoundError is one: the array or its version
            if not self.backend.exists(f"{folder}/zarr.json"):
                raise StoreError(
                    f"version {folder.rsplit('/', 1)[-1]} of partition {asset}/{key} is gone "
                    f"from {self.url}: it was rebuilt or deleted since it was looked up (for "
                    "a version a dataset manifest lists: rebuilt after the manifest was "
                    "written; rebuild the dataset manifest); read it again"
                ) from None
            group = zarr.open_group(zstore, mode="r")
            arrays = sorted(group.array_keys())
            raise StoreError(f"partition {asset}/{key} has no array {name!r}: {arrays}") from None
        except OSError as exc:
            raise self.backend.failure("read", f"{folder}/{name}/zarr.json", exc) from None

    def chunked(self, asset: str, key: str, name: str, version: str | None = None) -> ChunkedArray:
        """Array ``name`` of a partition for fast whole, region or chunk reads."""
        listed, array = None, None
        if version is None:
            record = self.commit_record(asset, key)
            version = record["version"]
            listed = self._listing(self.version_path(asset, key, version), record)
            array = self._recorded_array(record, asset, key, name)
        folder = self.version_path(asset, key, version)
        if array is None:
            array = self.open_array(asset, key, name, version)
        return ChunkedArray(array, self.backend, f"{folder}/{name}", f"{folder}/zarr.json",
                            self.tier, self.identity, listed)  # fmt: skip

    def _recorded_array(
        self, record: dict[str, Any], asset: str, key: str, name: str
    ) -> zarr.Array | None:
        """Array ``name`` of the version ``record`` commits, opened from the ``zarr.json``
        the record holds (no GET of it); None where the record holds none (written by an
        older zarrfeed, or no such array): then the array's own metadata is read.  A record
        whose copy disagrees with its own shape, dtype or chunks is refused."""
        summary = record["arrays"].get(name)
        meta = summary.get("zarr_json") if isinstance(summary, dict) else None
        if meta is None:
            return None
        folder = self.version_path(asset, key, record["version"])
        path = f"{folder}/{check_key(name)}"
        try:
            zstore = self.backend.zarr_store(folder, read_only=True)
            array = zarr.Array(zarr.AsyncArray(meta, StorePath(zstore, name)))
        except (TypeError, ValueError, KeyError) as exc:
            raise StoreError(f"{path}: the commit record's zarr.json is invalid ({exc})") from None
        if (
            list(array.shape) != summary["shape"]
            or str(array.dtype) != summary["dtype"]
            or list(array.chunks) != summary["chunks"]
        ):
            raise StoreError(
                f"{path}: the commit record's zarr.json ({array.dtype} {array.shape}, chunks "
                f"{array.chunks}) disagrees with the record ({summary['dtype']} "
                f"{summary['shape']}, chunks {summary['chunks']}): rebuild the partition"
            )
        return array

    def _listing(self, folder: str, record: dict[str, Any]) -> frozenset[str] | None:
        """Every object path of the committed version in ``folder``, from one listing on an
        object store (a chunk never written then costs no GET): only when the listed bytes
        add up to the ``stored_bytes`` its commit record counted, so a listing that lags
        the writes is never taken for fill values; else None (every chunk is then read).
        Kept per version: a committed version never changes."""
        stored = record.get("stored_bytes")
        if self.local or not isinstance(stored, int):
            return None
        found = self._listings.get(folder)
        if found is None:
            sizes = self.backend.sizes(folder)
            if sum(sizes.values()) != stored:
                return None
            if len(self._listings) >= LISTINGS_KEPT:
                self._listings.clear()
            found = self._listings[folder] = frozenset(sizes)
        return found

    def read_array(self, asset: str, key: str, name: str, version: str | None = None) -> np.ndarray:
        """All of array ``name`` of a committed partition, decoded in threads."""
        return self.chunked(asset, key, name, version).read()

    def read_partition(
        self, asset: str, key: str, names: list[str], version: str | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Arrays ``names`` of the committed version of a partition (or of ``version``), all
        from that one version, and its attributes.  Read through the version's guard: a
        version removed meanwhile fails the read loudly, where a Zarr group opened before
        it would read the removed chunks as fill values."""
        if version is None:
            record = self.commit_record(asset, key)
            version, attrs = record["version"], record["attrs"]
        else:
            attrs = dict(self.open_partition(asset, key, version).attrs)
        return {n: self.read_array(asset, key, n, version) for n in names}, attrs

    # manifests ---------------------------------------------------------------------------
    def build_manifest(
        self, asset: str, keys: list[str] | None = None, **extra: Any
    ) -> dict[str, Any]:
        """Counts, shapes, dtypes and bytes of committed partitions: what training reads.

        ``keys`` limits it to those partitions (default: every committed one).  Each
        partition names its version, so a reader of the manifest reads exactly what it
        lists or fails loudly.
        """
        found = self.record_summaries(asset)
        keys = list(found) if keys is None else keys
        missing = [k for k in keys if k not in found]
        if missing:
            raise StoreError(f"no committed partitions {missing[:5]} of {asset!r} in {self.url}")
        return _manifest(asset, self.url, [found[k] for k in keys], extra)

    def write_dataset(
        self,
        name: str,
        assets: list[str],
        withheld: Mapping[str, list[str]] | None = None,
        lineage: Sequence[StoredAsset] = (),
        settings: Mapping[str, Any] | None = None,
        retention: Retention | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """:meth:`plan_dataset` and :meth:`publish_dataset`, for a dataset without tables."""
        plan = self.plan_dataset(name, assets, withheld, lineage, settings)
        return self.publish_dataset(plan, retention=retention, **extra)

    @gc_paused()  # 200,000 summaries and manifest entries, none of them garbage
    def plan_dataset(
        self,
        name: str,
        assets: list[str],
        withheld: Mapping[str, list[str]] | None = None,
        lineage: Sequence[StoredAsset] = (),
        settings: Mapping[str, Any] | None = None,
    ) -> DatasetPlan:
        """The next version of dataset ``name``, not yet visible: the keys committed in all
        of ``assets`` whose partitions passed every blocking check and make one sample.

        Keys present in only some assets (a partition still building, or one that failed to
        build) are listed as ``incomplete``, keys with a partition that failed a check as
        ``failed``; both are left out, so readers never meet half a sample or bad data.
        ``withheld`` (key → reasons) leaves out committed keys whose data is sound but whose
        source is in doubt (two raw items now claim the key), listed under ``failed`` too.
        ``lineage``: the stored assets whose dependencies a key's partitions must agree on
        (:func:`~zarrfeed.store.contract.mixed_builds`); a key that mixes two builds of a
        stage is left out under ``failed``, naming the stage to build again; so is a key
        built with another value of a setting its readers take per dataset than the
        dataset's (:func:`~zarrfeed.store.contract.mixed_settings`: the ``settings`` now,
        where any key was built with them, else the most common value).
        The plan's keys and pinned versions are what the dataset's tables are built from
        before :meth:`publish_dataset` makes it the current version.
        """
        held = {k: list(v) for k, v in (withheld or {}).items()}
        rows = self._updated_rows(name, assets, held, lineage, settings) or self._full_rows(
            assets, held, lineage, settings
        )
        return DatasetPlan(name, rows)

    @gc_paused()
    def publish_dataset(
        self,
        plan: DatasetPlan,
        tables: Mapping[str, Any] | None = None,
        retention: Retention | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Make ``plan`` the current version of its dataset, with ``tables`` (table name →
        its facts: partitions of ``layout.dataset_path(name)`` written for the plan) pinned
        at their committed versions; returns the manifest, with its ``id``.

        A version is a snapshot (:mod:`zarrfeed.store.snapshots`): it names exact partition
        and table versions, and whatever opens it reads those until it closes, while
        partitions are rebuilt, deleted or collected.  A plan with the same content as the
        current version keeps its id.  Partitions carry what reading needs (key, version,
        arrays, bytes), not their provenance: training parses this manifest at start,
        50,000 partitions of four assets at a time; provenance is in the commit records.
        """
        name, rows, facts = plan.name, plan.rows, dict(tables or {})
        records = self.commit_records(dataset_path(name), sorted(facts)) if facts else {}
        pins = {t: r["version"] for t, r in records.items() if r is not None}
        digest = rows.digest(facts)
        extra = {k: v for k, v in extra.items() if k not in ("id", "created_unix", "tables")}

        def write(head: dict[str, Any]) -> bytes:
            return rows.manifest(name, self.url, {**extra, **head}, _json_default)[0]

        head = self.snapshots.publish(name, digest, pins, retention or Retention(), write)
        manifest = rows.manifest(name, self.url, {**extra, **head}, _json_default)[1]
        with suppress(ZarrfeedError, OSError):  # older rows only mean more records to read
            self.backend.write_atomic(self._rows_path(name), rows.dumps(self.url))
        return manifest

    def _rows_path(self, name: str) -> str:
        return self._meta("manifests", f"{check_asset(name)}.rows")

    def _full_rows(
        self,
        assets: list[str],
        withheld: dict[str, list[str]],
        lineage: Sequence[StoredAsset],
        settings: Mapping[str, Any] | None = None,
    ) -> Rows:
        """:meth:`write_dataset`'s rows from every asset's record summaries."""
        found = {a: self._summaries(a) for a in assets}
        records = {a: out for a, (out, _) in found.items()}
        committed = {a: set(out) for a, out in records.items()}
        candidates = sorted(set.intersection(*committed.values())) if committed else []
        rows = Rows(assets)
        for a, out in records.items():
            for k in candidates:
                bad = failed_checks(out[k])
                if bad:
                    rows.failed.setdefault(k, []).extend(f"{a}:{n}" for n in bad)
        for k in candidates if lineage else ():
            mixed = mixed_builds(lineage, {a: records[a][k] for a in assets})
            if mixed:
                rows.failed.setdefault(k, []).extend(mixed)
        sound = [k for k in candidates if k not in rows.failed and k not in withheld]
        samples = {k: {a: records[a][k] for a in assets} for k in sound} if lineage else {}
        for k, mixed in mixed_settings(lineage, samples, settings).items():
            rows.failed.setdefault(k, []).extend(mixed)
        for k, reasons in withheld.items():
            if k in candidates:
                rows.failed.setdefault(k, []).extend(reasons)
        for k in candidates:
            if k not in rows.failed:
                rows.add(k, [_entry(records[a][k], provenance=False) for a in assets])
        rows.incomplete = set().union(*committed.values()) - set(candidates)
        rows.positions = {a: after for a, (_, after) in found.items()}
        rows.withheld = withheld
        return rows

    def _updated_rows(
        self,
        name: str,
        assets: list[str],
        withheld: dict[str, list[str]],
        lineage: Sequence[StoredAsset],
        settings: Mapping[str, Any] | None = None,
    ) -> Rows | None:
        """The previous rows of dataset ``name`` with the keys its assets' change logs name
        since then read again (a key withheld or released counts as changed); None when
        there are no such rows or a log does not cover the time since."""
        looked = now_ns()
        try:
            rows = Rows.parse(self.backend.read(self._rows_path(name)), assets, self.url)
        except FileNotFoundError:
            return None
        if rows is None:
            return None
        known = bool(rows.positions)
        logs = {a: self._covered(a, rows.positions.get(a), looked, known) for a in assets}
        if any(intents is None for intents in logs.values()):
            return None
        changed = {i.key for intents in logs.values() for i in intents}
        before = rows.withheld
        changed |= {k for k in before.keys() | withheld.keys() if before.get(k) != withheld.get(k)}
        fresh = {
            a: {k: summarise(r) for k, r in self.commit_records(a, sorted(changed)).items() if r}
            for a in assets
        }
        samples = {
            k: {a: fresh[a][k] for a in assets}
            for k in changed
            if all(k in fresh[a] for a in assets)
        }
        kept = next((k for k in rows.rows if k not in changed), None)
        if kept is not None and any(spec.per_dataset for spec in lineage):
            reference = {a: summarise(self.commit_record(a, kept)) for a in assets}
        else:
            reference = None
        settled = changed_settings(lineage, reference, samples, settings, rows.failed)
        if settled is None:
            return None  # the dataset's value of a per-dataset setting may change: judge all
        for k in sorted(changed):
            rows.leave_out(k)
            present = [a for a in assets if k in fresh[a]]
            if len(present) < len(assets):
                if present:
                    rows.incomplete.add(k)
                continue
            bad = [f"{a}:{n}" for a in assets for n in failed_checks(fresh[a][k])]
            bad += mixed_builds(lineage, {a: fresh[a][k] for a in assets})
            bad += settled.get(k, [])
            if bad or k in withheld:
                rows.failed[k] = bad + withheld.get(k, [])
                continue
            rows.add(k, [_entry(fresh[a][k], provenance=False) for a in assets])
        rows.positions = {a: _next_position(looked, logs[a], fresh[a]) for a in assets}
        rows.withheld = withheld
        return rows

    def consolidate(
        self,
        dataset: str,
        asset: str,
        keys: list[str],
        arrays: list[str],
        versions: list[str] | None = None,
        *,
        table: str,
    ) -> dict[str, Any]:
        """Concatenate ``arrays`` of ``asset`` over ``keys`` into one partition for training.

        Written as partition ``table`` of the dataset's tables (``layout.dataset_path``) with an
        ``offsets`` array (rows of key ``i`` are ``offsets[i]:offsets[i+1]``), so a loader
        over 10,000 partitions opens one group instead of 10,000.  Incremental: the rows of a
        key whose committed version is the one the previous consolidation read are taken from
        it, so only rebuilt or new partitions are read; with nothing changed, nothing is
        written.  ``versions``: the version of each key to read (a dataset manifest's), by
        default the committed ones.
        """
        part = table
        if versions is None:
            found = self.record_summaries(asset)
            missing = [k for k in keys if k not in found]
            if missing:
                raise StoreError(
                    f"no committed partitions {missing[:5]} of {asset!r} in {self.url}"
                )
            versions = [found[k]["version"] for k in keys]
        table = dataset_path(dataset)
        seen, at, rows = self._previous_consolidation(table, part, asset, arrays)
        if at is not None and list(seen.items()) == list(zip(keys, versions, strict=False)):
            return {"rows": rows, "keys": len(keys)}
        offsets = self.read_array(table, part, "offsets", at) if at else np.zeros(1, np.int64)
        tables = {name: self.read_array(table, part, name, at) for name in arrays} if at else {}
        index = {k: i for i, k in enumerate(seen)}
        parts: dict[str, list[np.ndarray]] = {name: [] for name in arrays}
        counts = []
        for key, version in zip(keys, versions, strict=True):
            if seen.get(key) == version:
                lo, hi = offsets[index[key]], offsets[index[key] + 1]
                for name in arrays:
                    parts[name].append(tables[name][lo:hi])
            else:
                for name in arrays:
                    parts[name].append(self.read_array(asset, key, name, version))
            counts.append(len(parts[arrays[0]][-1]))
        offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        attrs = {"source_asset": asset, "keys": keys, "versions": versions}
        with self.write_partition(table, part, attrs) as w:
            w.write("offsets", offsets, read="whole")
            for name, chunks in parts.items():
                w.write(name, np.concatenate(chunks) if chunks else np.zeros(0), read="rows")
        return {"rows": int(offsets[-1]), "keys": len(keys)}

    def _previous_consolidation(
        self, table: str, part: str, asset: str, arrays: list[str]
    ) -> tuple[dict[str, str], str | None, int]:
        """(key → the version it was read at, the consolidation's own version, its rows) of the
        committed consolidation of ``asset`` in ``table``; ({}, None, 0) when there is none to
        reuse."""
        if not self.has_partition(table, part):
            return {}, None, 0
        record = self.commit_record(table, part)
        attrs = record["attrs"]
        if attrs.get("source_asset") != asset or "versions" not in attrs:
            return {}, None, 0  # another asset's, or written before versions were recorded
        if set(arrays) - set(record["arrays"]):
            return {}, None, 0
        rows = int(record["arrays"][arrays[0]]["shape"][0]) if arrays else 0
        return dict(zip(attrs["keys"], attrs["versions"], strict=True)), record["version"], rows

    def read_manifest(self, name: str, version: str | None = None) -> dict[str, Any]:
        """The manifest of version ``version`` of dataset ``name`` (default: its current
        version); a version past retention fails naming it and the retention."""
        return self.snapshots.read(check_asset(name), version)

    def open_dataset(
        self, name: str, version: str | None = None
    ) -> tuple[dict[str, Any], Lease | None]:
        """The manifest of a dataset version and a lease that keeps it from collection until
        released (None for a manifest written before datasets had versions).  The lease is
        taken right after the manifest is read, within the window collection keeps a
        just-superseded version for; if it came late, the version is checked again."""
        begun = time.time()
        manifest = self.read_manifest(name, version)
        if manifest.get("id") is None:
            return manifest, None
        lease = Lease(self.backend, name, manifest["id"])
        if time.time() - begun > MARGIN_S / 2 and not self.backend.exists(
            self.backend.join(snapshot_path(name, manifest["id"]))
        ):
            lease.release()
            raise StoreError(f"version {manifest['id']} of dataset {name!r} was collected "
                             "while being opened: open it again")  # fmt: skip
        return manifest, lease

    def dataset_versions(self, name: str) -> list[dict[str, Any]]:
        """Every stored version of dataset ``name``, oldest first: id, created, keys, the
        bytes its partitions hold, and the bytes no other version or commit holds."""
        committed: dict[str, set[str]] = {}
        out, seen = [], set()
        pointer = self.snapshots.pointer(name) or {}
        for snapshot in self.snapshots.ids(name):
            try:
                manifest = self.read_manifest(name, snapshot)
            except StoreError:
                continue  # collected meanwhile
            stored = retained = 0
            for path, asset in manifest["assets"].items():
                if path not in committed:
                    found = self.record_summaries(path)
                    committed[path] = {s["version"] for s in found.values()}
                for p in asset["partitions"]:
                    stored += p["stored_bytes"]
                    if p["version"] not in committed[path] and (path, p["version"]) not in seen:
                        retained += p["stored_bytes"]
                        seen.add((path, p["version"]))
            out.append({
                "id": snapshot,
                "created_unix": manifest.get("created_unix"),
                "keys": len(manifest["keys"]),
                "stored_bytes": stored,
                "retained_bytes": retained,
                "current": snapshot == pointer.get("id"),
            })  # fmt: skip
        return out


@dataclass(frozen=True)
class DatasetPlan:
    """The next version of a dataset before it is published (:meth:`ZarrStore.plan_dataset`)."""

    name: str
    rows: Rows

    @property
    def keys(self) -> list[str]:
        return sorted(self.rows.rows)

    def versions(self, asset: str) -> list[str]:
        """The version of each key's partition of ``asset``, in the order of :attr:`keys`."""
        return self.rows.versions(asset)


def pinned_versions(manifest: Mapping[str, Any]) -> dict[str, set[str]]:
    """Store path → the versions a dataset manifest names (its partitions and tables)."""
    out = {path: {p["version"] for p in a["partitions"]} for path, a in manifest["assets"].items()}
    tables = dataset_path(manifest["dataset"])
    out.setdefault(tables, set()).update((manifest.get("tables") or {}).values())
    return out


def _young_enough(asset: str, key: str, version: str) -> None:
    """Refuse to commit a version that a sweep may be removing: one older than the grace
    period after which unnamed versions are collected, less ``MARGIN_S`` (the clocks of
    the machines sharing a store agree within half of it; the rest is left for the record's
    own write)."""
    age = time.time() - (version_time(version) or time.time())
    if age >= VERSION_GRACE_S - MARGIN_S:
        raise StoreError(
            f"partition {asset}/{key}: writing took {age:.0f} s, too close to the "
            f"{VERSION_GRACE_S:.0f} s after which unnamed versions are collected; nothing "
            "was committed: rerun it, or raise zarrstore.VERSION_GRACE_S"
        )


PROVENANCE = ("source", "source_sha256", "code_version", "fingerprint")
SUMMARY_ATTRS = (*PROVENANCE, "source_stamp", UPSTREAM, CONTENT, "params")


def _next_position(looked: int, intents: list[Intent], found: dict[str, Any]) -> int:
    """Where the next look at the change log starts: ``MARGIN_S`` before this one, and no
    later than a key's latest intent younger than the version grace whose record does not
    name it yet (a commit still landing)."""
    grace = int(VERSION_GRACE_S * 1e9)
    after = looked - int(MARGIN_S * 1e9)
    latest = {i.key: i for i in intents}  # an earlier commit landing late notes again
    for i in latest.values():
        version = (found.get(i.key) or {}).get("version")
        landed = version == i.version or (i.version == DELETED and version is None)
        if not landed and looked - i.ns < grace:
            after = min(after, i.ns)
    return after


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """What manifests, datasets and the nightly evaluation need of a commit record (a third
    of its size: no codecs, no parameters, no HU decision)."""
    return {
        "key": record["key"],
        "version": record["version"],
        "committed_unix": record.get("committed_unix", 0),
        "arrays": {
            n: {k: a[k] for k in ("shape", "dtype", "chunks", "nbytes")}
            for n, a in record["arrays"].items()
        },
        "stored_bytes": record["stored_bytes"],
        "attrs": {k: record["attrs"][k] for k in SUMMARY_ATTRS if k in record["attrs"]},
        "checks": record.get("checks") or {},
    }


def _manifest(
    asset: str,
    url: str,
    records: list[dict[str, Any]],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of one asset over commit-record summaries, with each partition's source,
    hash, code version and fingerprint."""
    arrays: dict[str, dict[str, Any]] = {}
    for r in records:
        for name, a in r["arrays"].items():
            entry = arrays.setdefault(name, {"dtypes": set(), "shapes": set(), "nbytes": 0})
            entry["dtypes"].add(a["dtype"])
            entry["shapes"].add(tuple(a["shape"]))
            entry["nbytes"] += a["nbytes"]
    stored = sum(r["stored_bytes"] for r in records)
    totals = {
        n: (e["dtypes"], [list(s) for s in e["shapes"]], e["nbytes"]) for n, e in arrays.items()
    }
    return {
        **asset_summary(asset, url, len(records), stored, totals),
        "partitions": [_entry(r, provenance=True) for r in records],
        **extra,
    }


def _entry(summary: dict[str, Any], provenance: bool) -> dict[str, Any]:
    """A manifest's partition: key, version, arrays (shape, dtype, chunks, nbytes: the
    summary's own dicts, not copies), stored bytes, and perhaps the provenance."""
    entry = {k: summary[k] for k in ("key", "version", "arrays", "stored_bytes")}
    if provenance:
        entry |= {k: summary["attrs"].get(k) for k in PROVENANCE}
    return entry


def zarr_json(array: zarr.Array) -> dict[str, Any]:
    """The ``zarr.json`` document zarr writes for ``array``."""
    buffers = array.metadata.to_buffer_dict(default_buffer_prototype())
    return json.loads(buffers["zarr.json"].to_bytes())


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, set):
        return sorted(obj)  # deterministic records and manifests
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")
