"""The Zarr store: one group per asset, one group of arrays per partition, atomic commits.

Layout under the root (a local folder or an fsspec URL such as ``s3://bucket/prefix``)::

    <asset>/<key>/zarr.json                    partition group; attributes = provenance
    <asset>/<key>/<array>/...                  its arrays
    .zarrfeed/commits/<asset>/<key>.json       commit record, written last
    .zarrfeed/manifests/<asset>.json           the dataset manifest training consumes
    .zarrfeed/staging/<uuid>/                  partitions being written (never listed)

A partition is written under staging and only then moved into place: on a local disk by one
``rename``; on an object store by copying the finished objects.  Its commit record is written
after that, and readers list partitions by their records, so a crash never leaves a partition
that looks complete.  Bookkeeping lives outside the asset groups so that the Zarr hierarchy
holds nothing but groups and arrays.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import zarr
from fsspec.implementations.local import LocalFileSystem
from zarr.storage import FsspecStore, LocalStore

import zarrfeed
from zarrfeed.errors import StoreError
from zarrfeed.store.chunkio import read_array, write_from
from zarrfeed.store.codecs import Content, Read, chunks_for, compressors_for
from zarrfeed.store.keys import check_asset, check_key

META = ".zarrfeed"


class PartitionWriter:
    """Arrays of one partition being written; committed by :meth:`ZarrStore.write_partition`."""

    def __init__(self, zstore: zarr.abc.store.Store, attrs: dict[str, Any]) -> None:
        self._zstore = zstore
        self.attrs: dict[str, Any] = dict(attrs)
        self.arrays: dict[str, zarr.Array] = {}

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
        self.arrays[name] = arr
        return arr

    def write(self, name: str, data: np.ndarray, **kwargs: Any) -> zarr.Array:
        """Create array ``name`` and write ``data`` into it (chunks coded in threads)."""
        data = np.asarray(data)
        arr = self.create(name, data.shape, data.dtype, **kwargs)
        write_from(arr, data)
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
            }
            for name, a in self.arrays.items()
        }


class ZarrStore:
    """Committed partitions of every asset under one root URL or folder."""

    def __init__(self, url: str | Path, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = storage_options or {}
        self.fs, root = fsspec.core.url_to_fs(str(url), **self.storage_options)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")
        self.url = self.root if self.local else self.fs.unstrip_protocol(self.root)

    def __repr__(self) -> str:
        return f"ZarrStore({self.url!r})"

    # paths -------------------------------------------------------------------------------
    def path(self, asset: str, key: str | None = None) -> str:
        parts = [self.root, check_asset(asset)]
        if key is not None:
            parts.append(check_key(key))
        return "/".join(parts)

    def _meta(self, *parts: str) -> str:
        return "/".join([self.root, META, *parts])

    def _record_path(self, asset: str, key: str) -> str:
        return self._meta("commits", check_asset(asset), f"{check_key(key)}.json")

    def _zarr_store(self, path: str, read_only: bool) -> zarr.abc.store.Store:
        if self.local:
            return LocalStore(path, read_only=read_only)
        return FsspecStore.from_url(
            self.fs.unstrip_protocol(path),
            storage_options=self.storage_options,
            read_only=read_only,
        )

    # writing -----------------------------------------------------------------------------
    @contextmanager
    def write_partition(
        self, asset: str, key: str, attrs: dict[str, Any] | None = None
    ) -> Iterator[PartitionWriter]:
        """Write a partition; it becomes visible only when the ``with`` block ends cleanly.

        An exception inside the block removes the staged data and leaves any previously
        committed version of the partition untouched.
        """
        final = self.path(asset, key)
        staging = self._meta("staging", uuid.uuid4().hex)
        self.fs.makedirs(staging, exist_ok=True)
        writer = PartitionWriter(self._zarr_store(staging, read_only=False), attrs or {})
        try:
            yield writer
            record = self._finish(writer, staging, asset, key)
            self._publish(staging, final, self._record_path(asset, key), record)
        except BaseException:
            self.fs.rm(staging, recursive=True)
            raise

    def _finish(self, writer: PartitionWriter, staging: str, asset: str, key: str) -> bytes:
        if not writer.arrays:
            raise StoreError(f"partition {asset}/{key} has no arrays; nothing to commit")
        group = zarr.open_group(writer._zstore, mode="r+")
        group.attrs.update(writer.attrs)
        stored = sum(self.fs.du(staging, total=False).values())
        now = time.time()
        record = {
            "asset": asset,
            "key": key,
            "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "committed_unix": now,
            "zarrfeed_version": zarrfeed.__version__,
            "arrays": writer.summary(),
            "stored_bytes": int(stored),
            "attrs": writer.attrs,
        }
        return json.dumps(record, default=_json_default).encode()

    def _publish(self, staging: str, final: str, record_path: str, record: bytes) -> None:
        self._ensure_groups(final.rsplit("/", 1)[0])
        if self.local:
            trash = None
            if os.path.exists(final):
                trash = self._meta("trash", uuid.uuid4().hex)
                os.makedirs(os.path.dirname(trash), exist_ok=True)
                os.rename(final, trash)
            os.rename(staging, final)
            _atomic_write_local(record_path, record)
            if trash:
                shutil.rmtree(trash, ignore_errors=True)
            return
        # Object stores have no rename: hide the old version, replace it, then record it.
        if self.fs.exists(record_path):
            self.fs.rm_file(record_path)
        if self.fs.exists(final):
            self.fs.rm(final, recursive=True)
        for src in self.fs.find(staging):
            self.fs.copy(src, final + src[len(staging) :])
        self.fs.pipe_file(record_path, record)
        self.fs.rm(staging, recursive=True)

    def _ensure_groups(self, path: str) -> None:
        """Group metadata for the root and each asset level, so the hierarchy is browsable."""
        rel = path[len(self.root) :].strip("/")
        parts = rel.split("/") if rel else []
        root_store = self._zarr_store(self.root, read_only=False)
        for i in range(len(parts) + 1):
            sub = "/".join(parts[:i])
            meta = f"{self.root}/{sub}/zarr.json" if sub else f"{self.root}/zarr.json"
            if not self.fs.exists(meta):
                zarr.open_group(root_store, path=sub, mode="a")

    def delete_partition(self, asset: str, key: str) -> None:
        final, record = self.path(asset, key), self._record_path(asset, key)
        if self.fs.exists(record):
            self.fs.rm_file(record)
        if self.fs.exists(final):
            self.fs.rm(final, recursive=True)

    def clean_staging(self, older_than_s: float = 3600.0) -> int:
        """Remove staging folders left by crashed writers; returns how many were removed."""
        removed, now = 0, time.time()
        for folder in ("staging", "trash"):
            base = self._meta(folder)
            if not self.fs.exists(base):
                continue
            for entry in self.fs.ls(base, detail=True):
                mtime = entry.get("mtime") or entry.get("created") or 0
                mtime = mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)
                if now - mtime >= older_than_s:
                    self.fs.rm(entry["name"], recursive=True)
                    removed += 1
        return removed

    # reading -----------------------------------------------------------------------------
    def list_partitions(self, asset: str) -> list[str]:
        """Keys of the committed partitions of ``asset``, sorted."""
        base = self._meta("commits", check_asset(asset))
        if not self.fs.exists(base):
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False))
        return sorted(n[: -len(".json")] for n in names if n.endswith(".json"))

    def has_partition(self, asset: str, key: str) -> bool:
        return self.fs.exists(self._record_path(asset, key))

    def outdated(
        self, asset: str, key: str, code_version: str, source_mtime: float | None = None
    ) -> str | None:
        """Why partition ``key`` of ``asset`` needs a rebuild, or None when it is current.

        Missing, built by another code version, or older than its source's last change: the
        cheap tests a nightly schedule can afford for every partition (no hashing).
        """
        if not self.has_partition(asset, key):
            return "missing"
        record = self.commit_record(asset, key)
        if record["attrs"].get("code_version") != code_version:
            return f"code version {record['attrs'].get('code_version')} → {code_version}"
        if source_mtime is not None and source_mtime > record.get("committed_unix", 0):
            return "source changed after the last build"
        return None

    def commit_record(self, asset: str, key: str) -> dict[str, Any]:
        """The commit record of a partition: its arrays, stored bytes and provenance."""
        try:
            return json.loads(self.fs.cat_file(self._record_path(asset, key)))
        except FileNotFoundError:
            raise StoreError(f"no committed partition {key!r} of {asset!r} in {self.url}") from None

    def open_partition(self, asset: str, key: str) -> zarr.Group:
        """The read-only Zarr group of a committed partition."""
        if not self.has_partition(asset, key):
            raise StoreError(f"no committed partition {key!r} of {asset!r} in {self.url}")
        return zarr.open_group(self._zarr_store(self.path(asset, key), read_only=True), mode="r")

    def read_array(self, asset: str, key: str, name: str) -> np.ndarray:
        """All of array ``name`` of a committed partition, decoded in threads."""
        return read_array(self.open_array(asset, key, name))

    def open_array(self, asset: str, key: str, name: str) -> zarr.Array:
        group = self.open_partition(asset, key)
        try:
            return group[check_key(name)]
        except KeyError:
            arrays = sorted(self.commit_record(asset, key)["arrays"])
            raise StoreError(f"partition {asset}/{key} has no array {name!r}: {arrays}") from None

    # manifests ---------------------------------------------------------------------------
    def build_manifest(
        self, asset: str, keys: list[str] | None = None, **extra: Any
    ) -> dict[str, Any]:
        """Counts, shapes, dtypes and bytes of committed partitions (seed 003's manifest).

        ``keys`` limits it to those partitions (default: every committed one).
        """
        keys = self.list_partitions(asset) if keys is None else keys
        records = [self.commit_record(asset, k) for k in keys]
        arrays: dict[str, dict[str, Any]] = {}
        for r in records:
            for name, a in r["arrays"].items():
                entry = arrays.setdefault(name, {"dtypes": set(), "shapes": set(), "nbytes": 0})
                entry["dtypes"].add(a["dtype"])
                entry["shapes"].add(tuple(a["shape"]))
                entry["nbytes"] += a["nbytes"]
        stored = sum(r["stored_bytes"] for r in records)
        raw = sum(a["nbytes"] for r in records for a in r["arrays"].values())
        return {
            "asset": asset,
            "store": self.url,
            "zarrfeed_version": zarrfeed.__version__,
            "total_partitions": len(records),
            "total_stored_bytes": stored,
            "total_nbytes": raw,
            "compression_ratio": raw / stored if stored else None,
            "arrays": {
                name: {
                    "dtypes": sorted(e["dtypes"]),
                    "shapes": sorted(list(s) for s in e["shapes"]),
                    "nbytes": e["nbytes"],
                }
                for name, e in sorted(arrays.items())
            },
            "partitions": [
                {
                    "key": r["key"],
                    "arrays": {
                        n: {"shape": a["shape"], "dtype": a["dtype"]}
                        for n, a in r["arrays"].items()
                    },
                    "stored_bytes": r["stored_bytes"],
                    "source": r["attrs"].get("source"),
                    "source_sha256": r["attrs"].get("source_sha256"),
                    "code_version": r["attrs"].get("code_version"),
                }
                for r in records
            ],
            **extra,
        }

    def write_manifest(self, asset: str, **extra: Any) -> dict[str, Any]:
        manifest = self.build_manifest(asset, **extra)
        self._write_manifest(asset, manifest)
        return manifest

    def write_dataset(self, name: str, assets: list[str], **extra: Any) -> dict[str, Any]:
        """The manifest of a dataset made of several assets: the keys committed in all of them.

        Keys present in only some assets (a partition still building, or one that failed)
        are listed as ``incomplete`` and left out, so readers never meet half a sample.
        """
        committed = {a: set(self.list_partitions(a)) for a in assets}
        keys = sorted(set.intersection(*committed.values())) if committed else []
        manifest = {
            "dataset": name,
            "store": self.url,
            "keys": keys,
            "incomplete": sorted(set().union(*committed.values()) - set(keys)),
            "assets": {a: self.build_manifest(a, keys=keys) for a in assets},
            **extra,
        }
        self._write_manifest(name, manifest)
        return manifest

    def consolidate(
        self, dataset: str, asset: str, keys: list[str], arrays: list[str]
    ) -> dict[str, Any]:
        """Concatenate ``arrays`` of ``asset`` over ``keys`` into one partition for training.

        Written as partition ``<asset's last part>`` of ``datasets/<dataset>`` with an
        ``offsets`` array (rows of key ``i`` are ``offsets[i]:offsets[i+1]``), so a loader
        over 10,000 partitions opens one group instead of 10,000.
        """
        parts: dict[str, list[np.ndarray]] = {name: [] for name in arrays}
        counts = []
        for key in keys:
            group = self.open_partition(asset, key)
            for name in arrays:
                parts[name].append(group[name][...])
            counts.append(len(parts[arrays[0]][-1]))
        offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        attrs = {"source_asset": asset, "keys": keys}
        with self.write_partition(f"datasets/{dataset}", asset.rsplit("/", 1)[-1], attrs) as w:
            w.write("offsets", offsets, read="whole")
            for name, chunks in parts.items():
                w.write(name, np.concatenate(chunks) if chunks else np.zeros(0), read="rows")
        return {"rows": int(offsets[-1]), "keys": len(keys)}

    def _write_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        data = json.dumps(manifest, indent=1, default=_json_default).encode()
        target = self._meta("manifests", f"{check_asset(name)}.json")
        if self.local:
            _atomic_write_local(target, data)
        else:
            self.fs.pipe_file(target, data)

    def read_manifest(self, asset: str) -> dict[str, Any]:
        try:
            return json.loads(
                self.fs.cat_file(self._meta("manifests", f"{check_asset(asset)}.json"))
            )
        except FileNotFoundError:
            raise StoreError(f"no manifest for {asset!r} in {self.url}; build it first") from None


def _atomic_write_local(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    Path(tmp).write_bytes(data)
    os.replace(tmp, path)


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
