"""The commit protocol: a partition is written into a fresh version folder, then published by
one atomic write of its commit record.

A version folder nothing names is a writer's work in progress; the one write of the record
(a rename of a temporary file on a disk, one PUT on an object store) commits it, so a crash
at any instant leaves the old commit or the new one, each with all its data, and nothing is
copied after it is written.  A write whose outcome is unknown is settled by reading the
record back.  The version a record replaces stays until the store's collection
(:mod:`zarrfeed.store.garbage`) finds nothing retains it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import zarrfeed
from zarrfeed.errors import StoreError, ZarrfeedError
from zarrfeed.store import jsonio
from zarrfeed.store.changes import DELETED, MARGIN_S, now_ns
from zarrfeed.store.chunkio import write_from
from zarrfeed.store.codecs import Content, Read, chunks_for, compressors_for
from zarrfeed.store.keys import check_key
from zarrfeed.store.stamps import PATTERN, match
from zarrfeed.store.stamps import stamp as new_stamp

# zarr (~0.3 s) is imported where an array is written: a code location that declares the
# stores without writing one (every run and step process loads one) does without it.
if TYPE_CHECKING:
    import zarr

    from zarrfeed.store.zarrstore import ZarrStore

LAYOUT = 2
# A version no record names is a writer's work in progress until it is this old.
VERSION_GRACE_S = 3600.0
_VERSION = re.compile(rf"v({PATTERN})-[0-9a-f]{{8}}")


def new_version(now: float | None = None) -> str:
    """A unique, sortable version name that carries its creation time (object stores give
    folders no mtime): ``v20261123T180102123Z-3fa2b1c4``."""
    return f"v{new_stamp(now)}-{uuid.uuid4().hex[:8]}"


def version_time(name: str) -> float | None:
    """Creation time of a version name; None for anything that is not one."""
    return match(_VERSION, name)


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
        import zarr

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


@contextmanager
def write_partition(
    store: ZarrStore, asset: str, key: str, attrs: dict[str, Any] | None = None
) -> Iterator[PartitionWriter]:
    """:meth:`ZarrStore.write_partition`."""
    version = new_version()
    folder = f"{store.path(asset, key)}/{version}"
    writer = PartitionWriter(store, folder, attrs or {})
    try:
        yield writer
        record = _finish(store, writer, asset, key, version)
    except BaseException:
        discard(store, folder)
        raise
    _publish(store, asset, key, version, record)


def discard(store: ZarrStore, folder: str) -> None:
    """Remove a version nothing names; if that fails too (the store is unreachable), the
    version stays for the store's collection and the original error is what is raised."""
    with suppress(ZarrfeedError, OSError):
        store.remove_version(folder)


def _finish(store: ZarrStore, writer: PartitionWriter, asset: str, key: str, version: str) -> bytes:
    if not writer.arrays:
        raise StoreError(f"partition {asset}/{key} has no arrays; nothing to commit")
    import zarr

    try:
        zarr.open_group(writer._zstore, mode="r+").attrs.update(writer.attrs)
    except OSError as exc:
        raise store.backend.failure("write", f"{writer.folder}/zarr.json", exc) from None
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
        "stored_bytes": store.backend.tree_bytes(writer.folder),
        "attrs": writer.attrs,
        "checks": dict(writer.checks),
    }
    return json.dumps(record, default=json_default).encode()


def _publish(store: ZarrStore, asset: str, key: str, version: str, record: bytes) -> None:
    """One atomic write of the record commits ``version``; then the version it replaced
    goes.  A write whose outcome is unknown (the connection broke after the request was
    sent) is settled by reading the record back: committed, or the new version is
    removed, or — when even that read fails — left for the store's collection."""
    folder = f"{store.path(asset, key)}/{version}"
    try:
        _ensure_groups(store, asset, key)
        store.backend.persist(folder)  # the data is durable before the record names it
        noted = store.changes(asset).note(key, version)  # readers look at this key again
        _young_enough(asset, key, version)  # again: making it durable takes time too
    except BaseException:
        discard(store, folder)
        raise
    try:
        store.backend.write_atomic(store.record_path(asset, key), record)  # the commit
    except BaseException:
        if not _settle(store, asset, key, version):
            raise
    if now_ns() - noted > MARGIN_S / 2 * 1e9:  # landed late: readers may have moved on
        store.changes(asset).note(key, version)
    # Committed.  The version it replaced stays: a dataset version or a live reader may
    # name it, and the store's collection removes it once nothing does.


def _settle(store: ZarrStore, asset: str, key: str, version: str) -> bool:
    """Whether a record write that raised committed ``version`` after all; the version
    is removed when it surely did not, and kept when the record cannot be read."""
    try:
        committed = committed_version(store, asset, key) == version
    except (ZarrfeedError, OSError):
        return False
    if not committed:
        discard(store, f"{store.path(asset, key)}/{version}")
    return committed


def committed_version(store: ZarrStore, asset: str, key: str) -> str | None:
    """The version the commit record of a partition names now (None: not committed)."""
    path = store.record_path(asset, key)
    try:
        data = store.backend.read(path)
    except FileNotFoundError:
        return None
    return jsonio.named(path, data).get("version")


def _ensure_groups(store: ZarrStore, asset: str, key: str) -> None:
    """Group metadata for the root, each asset level and the partition folder, so the
    hierarchy is browsable with any Zarr tool."""
    import zarr

    parts = [*asset.split("/"), key]
    backend = store.backend
    root_store = backend.zarr_store(store.root, read_only=False)
    for i in range(len(parts) + 1):
        sub = "/".join(parts[:i])
        if sub in store.groups:
            continue
        meta = backend.join(sub, "zarr.json") if sub else backend.join("zarr.json")
        if not backend.exists(meta):
            attrs = {} if sub else {"zarrfeed_layout": LAYOUT}
            # Writers of other partitions create the same groups: the first one wins.
            with suppress(zarr.errors.ContainsGroupError):
                zarr.open_group(root_store, path=sub, mode="a", attributes=attrs)
        store.groups.add(sub)


def remove_version(store: ZarrStore, folder: str) -> None:
    """Remove one version folder, its guard (``zarr.json``) first: a reader still holding it
    fails loudly rather than reading missing chunks as fill values."""
    store.backend.remove(f"{folder}/zarr.json")
    store.backend.remove_tree(folder)


def delete_partition(store: ZarrStore, asset: str, key: str) -> None:
    """:meth:`ZarrStore.delete_partition`."""
    store.changes(asset).note(key, DELETED)
    store.backend.remove(store.record_path(asset, key))


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
            "was committed: rerun it, or raise commits.VERSION_GRACE_S"
        )


def zarr_json(array: zarr.Array) -> dict[str, Any]:
    """The ``zarr.json`` document zarr writes for ``array``."""
    from zarr.buffer import default_buffer_prototype

    buffers = array.metadata.to_buffer_dict(default_buffer_prototype())
    return json.loads(buffers["zarr.json"].to_bytes())


def json_default(obj: Any) -> Any:
    """JSON for what records and manifests hold besides plain values: numpy scalars and
    arrays, paths, and sets (sorted, so the bytes are deterministic)."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, set):
        return sorted(obj)  # deterministic records and manifests
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")
