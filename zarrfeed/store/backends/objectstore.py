"""A store on any fsspec filesystem: S3-compatible object stores (``s3://``), ``memory://``."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from zarrfeed.errors import StoreError
from zarrfeed.processlocal import ProcessLocal
from zarrfeed.store.backends.base import Backend
from zarrfeed.store.backends.errors import USERINFO

if TYPE_CHECKING:
    import zarr

# Only the endpoint decides which server a URL means; credentials never reach an identity.
_IDENTITY_OPTIONS = ("endpoint_url",)
# botocore's "standard" retry mode retries 500/502/503/504, throttling (SlowDown) and cut
# connections with exponential backoff and jitter; s3fs adds its own retries on top for a few
# errors botocore does not know.  The standard AWS_MAX_ATTEMPTS / AWS_RETRY_MODE variables
# override the attempts and mode.  A listings cache would let one process miss another's
# writes (a commit record, a removed guard), so there is none.  ``max_pool_connections``:
# botocore's default of 10 connections per client caps every concurrent read at 10 GETs in
# flight, whatever fsspec gathers.
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 10, "read_timeout": 120, "max_pool_connections": 64},
    "use_listings_cache": False,
}
# s3fs sends a HEAD before every whole-object read to decide whether to split it into
# concurrent ranged GETs (above 50 MB): per chunk or record, that doubles the round trips.
# What the store reads whole is far smaller (a 50,000-partition manifest, the largest, is one
# ~100 MB object), so every read is one plain GET.
ONE_GET: dict[str, Any] = {"max_concurrency": 1}
S3_RETRIES = {"max_attempts": 8, "mode": "standard"}
T = TypeVar("T")


def _named(operation: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Turn a storage failure that survived the client's retries into a :class:`StoreError`
    naming the object, the server and what to do — with every credential blanked out."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def call(self: ObjectBackend, path: Any, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, path, *args, **kwargs)
            except (FileNotFoundError, StoreError):
                raise
            except Exception as exc:
                raise self.failure(operation, path, exc) from None

        return call

    return wrap


class ObjectBackend(Backend):
    """Any fsspec filesystem: S3-compatible object stores (``s3://``), ``memory://`` …

    There is no rename: a single PUT is the only atomic write, which is all the commit
    protocol needs (the commit record).  Credentials stay in ``storage_options`` (or the
    standard environment variables s3fs reads) and never enter ``url``, ``identity`` or an
    error message.  On ``s3://`` the client retries server errors, throttling and cut
    connections (:data:`S3_DEFAULTS`, overridable per option); what still fails raises a
    :class:`StoreError` that names the object.
    """

    retried = True  # botocore's and s3fs's retries (S3_RETRIES)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self._options = _with_defaults(url, self.storage_options)
        self.fs, root = fsspec.core.url_to_fs(url, **self._options)
        if isinstance(self.fs, LocalFileSystem):
            raise ValueError(f"{url} is a local path: use LocalBackend")
        self.root = root.rstrip("/")
        self.url = self.fs.unstrip_protocol(self.root)
        named = [self.storage_options.get(k) for k in _IDENTITY_OPTIONS]
        endpoint = next(filter(None, named), None) or _client_endpoint(self.fs)
        # The server, never its credentials: the endpoint is shown in errors and keys caches.
        self.endpoint: str | None = USERINFO.sub("", endpoint) if endpoint else None
        self.identity = f"{self.url}|{self.endpoint}" if self.endpoint else self.url
        s3 = fsspec.core.split_protocol(url)[0] in ("s3", "s3a")
        # Options of a read that is one GET of the object (see ONE_GET).
        self._one_get: dict[str, Any] = dict(ONE_GET) if s3 else {}
        self._reader = ProcessLocal(self._new_reader)  # the async filesystem zarr reads through

    def location(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    @_named("read")
    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path, **self._one_get)

    @_named("read")
    def read_many(self, paths: Sequence[str], threads: int = 8) -> list[bytes | None]:
        if not paths:
            return []
        found = self.fs.cat(list(paths), on_error="return", **self._one_get)
        out: list[bytes | None] = []
        for p in paths:
            value = found.get(p)
            if isinstance(value, FileNotFoundError) or value is None:
                out.append(None)
            elif isinstance(value, BaseException):
                raise self.failure("read", p, value)
            else:
                out.append(value)
        return out

    @_named("write")
    def write_atomic(self, path: str, data: bytes, parents: bool = True) -> None:
        self.fs.pipe_file(path, data)  # one PUT: atomic on every S3-compatible server

    @_named("write")
    def put_many(self, folder: str, objects: dict[str, bytes]) -> None:
        if objects:  # fsspec sends these concurrently on async filesystems (s3fs)
            self.fs.pipe({f"{folder}/{k}": v for k, v in objects.items()})

    @_named("read")
    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    @_named("list")
    def list_dir(self, path: str) -> list[str]:
        try:
            names = self.fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return [n.rstrip("/").rsplit("/", 1)[-1] for n in names if n.rstrip("/") != path]

    @_named("list")
    def list_stamps(self, path: str) -> dict[str, tuple[int, str]]:
        try:
            entries = self.fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            if e.get("type") == "directory":
                continue
            stamp = e.get("ETag") or e.get("etag") or e.get("LastModified") or e.get("created")
            out[e["name"].rstrip("/").rsplit("/", 1)[-1]] = (int(e.get("size") or 0), str(stamp))
        return out

    @_named("delete")
    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    @_named("delete")
    def remove_tree(self, path: str) -> None:
        if not hasattr(self.fs, "call_s3"):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)
            return
        found = self.fs.find(path, withdirs=True, detail=True)
        files = [p for p, e in found.items() if e["type"] != "directory"]
        if files:
            self.fs.rm(files)
        # Servers with real folders (SeaweedFS) keep empty ones listed after their objects
        # are gone, and a listed folder would look like a version: delete the folder keys
        # ("<prefix>/"), deepest first; elsewhere deleting a missing key is a no-op.
        folders = sorted({p for p, e in found.items() if e["type"] == "directory"} | {path})
        bucket = path.partition("/")[0]
        keys = [f"{p.partition('/')[2]}/" for p in reversed(folders) if p.partition("/")[2]]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1000 keys at most
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            self.fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": batch})

    @_named("list")
    def tree_bytes(self, path: str) -> int:
        return sum(self.sizes(path).values())

    @_named("list")
    def sizes(self, path: str) -> dict[str, int]:
        try:
            found = self.fs.find(path, detail=True)  # one LIST a 1000 objects (du HEADs each)
        except FileNotFoundError:
            return {}
        return {p: int(e["size"]) for p, e in found.items() if e.get("type") != "directory"}

    def zarr_store(self, path: str, read_only: bool) -> zarr.abc.store.Store:
        from zarr.storage import FsspecStore  # zarr loads with the first array opened

        reader = self._reader_fs() if read_only else None
        if reader is not None and reader.async_impl:
            return FsspecStore(reader, read_only=True, path=path)
        return FsspecStore.from_url(  # (zarr wraps a filesystem that is not asynchronous)
            self.fs.unstrip_protocol(path), storage_options=self._options, read_only=read_only
        )

    def _reader_fs(self) -> Any:
        """The asynchronous filesystem every read-only Zarr store of this process shares.

        fsspec caches a filesystem per thread, so each thread that opened an array made
        its own S3 client (about 30 ms of CPU, and new connections); readers read metadata
        objects only (chunks come through :meth:`read_many`), one GET each."""
        return self._reader.get()

    def _new_reader(self) -> Any:
        options = {**self._options, **self._one_get, "asynchronous": True}
        return fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **options)[0]


def _with_defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over :data:`S3_DEFAULTS` for ``s3://`` URLs (``config_kwargs`` merged key
    by key, so setting ``retries`` keeps the timeouts)."""
    if fsspec.core.split_protocol(url)[0] not in ("s3", "s3a"):
        return dict(options)
    retries = {
        "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", S3_RETRIES["max_attempts"])),
        "mode": os.environ.get("AWS_RETRY_MODE", S3_RETRIES["mode"]),
    }
    config = {**S3_DEFAULTS["config_kwargs"], "retries": retries}
    config |= options.get("config_kwargs", {})
    return {**S3_DEFAULTS, **options, "config_kwargs": config}


def _client_endpoint(fs: Any) -> str | None:
    """The endpoint an fsspec filesystem was configured with (s3fs: ``client_kwargs`` or the
    ``AWS_ENDPOINT_URL*`` variables it reads), so two servers' buckets never share an
    identity."""
    kwargs = getattr(fs, "client_kwargs", None) or {}
    return (
        getattr(fs, "endpoint_url", None)
        or kwargs.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
