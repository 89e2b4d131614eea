"""The Zarr store: one group per asset, immutable versions per partition, one-write commits.

Layout under the root (a local folder or an fsspec URL such as ``s3://bucket/prefix``)::

    zarr.json                                  root group (attribute zarrfeed_layout = 2)
    <asset>/<key>/<version>/zarr.json          a version of a partition; attributes = provenance
    <asset>/<key>/<version>/<array>/...        its arrays
    .zarrfeed/commits/<asset>/<key>.json       the commit record: names the committed version

(``zarrfeed.store.layout`` names every path outside the asset groups.)

:class:`ZarrStore` is the one entry point for storage; what it does lives in modules of
their own: the commit protocol (:mod:`~zarrfeed.store.commits`), commit records and their
summaries over the change logs (:mod:`~zarrfeed.store.records`), collection
(:mod:`~zarrfeed.store.garbage`) and array access (:mod:`~zarrfeed.store.arrays`).  Datasets
over the store are :mod:`zarrfeed.datasets`.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from zarrfeed.store import arrays, commits, garbage, records
from zarrfeed.store.backends import Backend, LocalBackend, open_backend
from zarrfeed.store.changes import ChangeLog
from zarrfeed.store.chunkio import ChunkedArray
from zarrfeed.store.commits import PartitionWriter
from zarrfeed.store.disktier import DiskTier, open_tier
from zarrfeed.store.garbage import Sweep
from zarrfeed.store.keys import check_asset, check_key
from zarrfeed.store.layout import META

if TYPE_CHECKING:
    import zarr  # imported by the array modules when one is opened or written


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
        self.listings: dict[str, frozenset[str]] = {}  # version folder -> its objects
        self.groups: set[str] = set()  # group metadata known to exist
        self._changes: dict[str, ChangeLog] = {}

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

    def meta_path(self, *parts: str) -> str:
        """A path under the store's bookkeeping folder (``.zarrfeed``)."""
        return self.backend.join(META, *parts)

    def record_path(self, asset: str, key: str) -> str:
        """Where the commit record of a partition is."""
        return self.meta_path("commits", check_asset(asset), f"{check_key(key)}.json")

    # writing -----------------------------------------------------------------------------
    def write_partition(
        self, asset: str, key: str, attrs: dict[str, Any] | None = None
    ) -> AbstractContextManager[PartitionWriter]:
        """Write a new version of a partition; it is committed only when the ``with`` block
        ends cleanly.  An exception inside the block removes the new version and leaves the
        committed one untouched."""
        return commits.write_partition(self, asset, key, attrs)

    def remove_version(self, folder: str) -> None:
        """Remove one version folder, its guard first."""
        commits.remove_version(self, folder)

    def delete_partition(self, asset: str, key: str) -> None:
        """Un-commit a partition; its versions stay while something retains them, and
        :meth:`collect` removes them after."""
        commits.delete_partition(self, asset, key)

    def collect(
        self, *, retained: Mapping[str, set[str]], older_than_s: float = commits.VERSION_GRACE_S
    ) -> Sweep:
        """Remove what nothing retains: versions no commit record names and ``retained``
        (store path → versions, e.g. those of dataset versions and live readers) does not,
        older than ``older_than_s`` (a writer at work is younger); change-log hours older
        than :data:`~zarrfeed.store.garbage.CHANGES_KEPT_S`; temporaries of dead writers."""
        return garbage.collect(self, retained, older_than_s)

    # reading -----------------------------------------------------------------------------
    def list_partitions(self, asset: str) -> list[str]:
        """Keys of the committed partitions of ``asset``, sorted."""
        return records.list_partitions(self, asset)

    def has_partition(self, asset: str, key: str) -> bool:
        return self.backend.exists(self.record_path(asset, key))

    def commit_record(self, asset: str, key: str) -> dict[str, Any]:
        """The commit record of a partition: its version, arrays, stored bytes, provenance."""
        return records.commit_record(self, asset, key)

    def commit_records(self, asset: str, keys: list[str]) -> dict[str, dict[str, Any] | None]:
        """Commit records of many partitions at once (None where one is not committed): one
        concurrent read instead of a round trip per key on an object store."""
        return records.commit_records(self, asset, keys)

    def changes(self, asset: str) -> ChangeLog:
        """The change log of ``asset``: one intent per commit, written before its record."""
        check_asset(asset)
        if asset not in self._changes:
            self._changes[asset] = ChangeLog(self.backend, asset)
        return self._changes[asset]

    def record_summaries(self, asset: str) -> dict[str, dict[str, Any]]:
        """Committed key → the summary of its commit record that manifests and the nightly
        evaluation use (:func:`~zarrfeed.store.records.summarise`), for every committed
        partition of ``asset``.

        Proportional to what changed: the next caller reads only the records the asset's
        change log names since the last look (:mod:`zarrfeed.store.records`).  Without a
        usable log (none, unreadable, or compacted past that time) it scans in full — one
        listing of the records with their change stamps, then only the records new or
        changed since — and logs why when the log should have served.
        """
        return records.summaries(self, asset)[0]

    def open_partition(self, asset: str, key: str, version: str | None = None) -> zarr.Group:
        """The read-only Zarr group of the committed version of a partition, or of
        ``version`` (a reader pinned to what a manifest listed)."""
        return arrays.open_partition(self, asset, key, version)

    def open_array(self, asset: str, key: str, name: str, version: str | None = None) -> zarr.Array:
        """Array ``name`` of the committed version of a partition (or of ``version``).

        The array's own metadata is the only object read besides the commit record — one
        round trip each on an object store; the group is looked at only to explain a miss.
        """
        return arrays.open_array(self, asset, key, name, version)

    def chunked(self, asset: str, key: str, name: str, version: str | None = None) -> ChunkedArray:
        """Array ``name`` of a partition for fast whole, region or chunk reads."""
        return arrays.chunked(self, asset, key, name, version)

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
        return arrays.read_partition(self, asset, key, names, version)
