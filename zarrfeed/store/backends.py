"""Where the store's bytes live: one class per backend behind one small interface.

The store needs a handful of operations from storage — read one object, read many at once,
publish one object atomically, list a folder, remove a tree — and a Zarr store for the arrays.
:class:`LocalBackend` serves a folder on a local (or network) disk; :class:`ObjectBackend`
serves any fsspec filesystem (``s3://``, ``gs://``, ``memory://``).  Everything above this
module (commits, manifests, chunk reads, the training cache) uses only this interface, so it
works the same on both.

Paths passed in and returned are full backend paths (``/abs/root/...`` or ``bucket/prefix/...``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import zarr
from fsspec.implementations.local import LocalFileSystem
from zarr.storage import FsspecStore, LocalStore

from zarrfeed.errors import StoreError

TEMPORARY = ".tmp"  # suffix of a LocalBackend.write_atomic in progress: <name>.<unix>-<id>.tmp


def write_file_atomic(
    path: str | os.PathLike,
    tmp: str | os.PathLike,
    *parts: bytes,
    durable: bool = True,
    opener: Callable[[str, int], int] | None = None,
) -> None:
    """Write ``parts`` to the local file ``tmp``, flush it to the disk and rename it onto
    ``path``: a reader sees the old file or the new one whole, never a torn one; ``tmp`` is
    removed whatever fails (a crash leaves it for the caller's clean-up by its name).

    ``durable=False`` skips the fsync: a process killed at any instant still leaves the old
    file or the new one, but a power loss may leave the new name with lost blocks — only for
    files whose readers verify them (a checksum) and can fetch them again.  ``opener``
    opens ``tmp`` (as :func:`open`'s: a cache's, for its file mode)."""
    try:
        with open(tmp, "wb", opener=opener) as f:
            for part in parts:
                f.write(part)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# Only the endpoint decides which server a URL means; credentials never reach an identity.
_IDENTITY_OPTIONS = ("endpoint_url",)
# Options and variables that hold secrets: their values are blanked out of every error text.
_SECRET_OPTIONS = ("key", "secret", "token", "aws_access_key_id", "aws_secret_access_key",
                   "aws_session_token")  # fmt: skip
_SECRET_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
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


class Backend:
    """Storage for one store root.  ``url`` names it for people; ``identity`` is what makes
    its bytes unique on this machine (the resolved path, or the URL plus the endpoint)."""

    root: str
    url: str
    identity: str
    endpoint: str | None = None
    storage_options: dict[str, Any] = {}  # noqa: RUF012  (read-only class default)

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def location(self, path: str) -> str:
        """``path`` as a person would name it (a URL on an object store)."""
        return path

    def failure(self, operation: str, path: str | Sequence[str], exc: BaseException) -> StoreError:
        """The error for a failed ``operation`` on ``path``, safe to log: it names the
        object and the server, never a credential.  A full disk, a denied permission or a
        read-only file system says so, with the free space or the mode and owner; the
        credentials are named only when the server refused them."""
        where = self.location(path) if isinstance(path, str) else f"{len(path)} objects"
        local = self.local_path(path, exc)
        problem = disk_problem(exc, local) if local else None
        if problem:
            return StoreError(f"could not {operation} {where}: {problem}")
        server = f" at {self.endpoint}" if self.endpoint else ""
        text = redact(f"{type(exc).__name__}: {exc}", self.storage_options)
        retried = ", retries included" if self.retried else ""
        if self.retried and refused_credentials(exc, text):
            advice = (
                f"the store {self.url}{server} refused these credentials: check that they "
                f"allow {operation} there"
            )
        else:
            advice = f"check that the store {self.url}{server} is reachable and allows {operation}"
        return StoreError(
            f"could not {operation} {where} ({text}){retried}: {advice}, then run it again"
        )

    retried = False  # whether the client retried a failure before it reached failure()

    def local_path(self, path: str | Sequence[str], exc: BaseException) -> str | None:
        """The file on this machine's disks that ``exc`` failed on, if there is one."""
        return None

    def read(self, path: str) -> bytes:
        """The whole object; ``FileNotFoundError`` when it does not exist."""
        raise NotImplementedError

    def read_many(self, paths: Sequence[str], threads: int = 8) -> list[bytes | None]:
        """Many objects at once (None where one is missing), in the order given."""
        raise NotImplementedError

    def write_atomic(self, path: str, data: bytes) -> None:
        """Publish ``data`` at ``path``: readers see the old object or the new one, whole."""
        raise NotImplementedError

    def put_many(self, folder: str, objects: dict[str, bytes]) -> None:
        """Write objects (key relative to ``folder`` → bytes) into a folder nobody reads yet."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def list_dir(self, path: str) -> list[str]:
        """Names of the entries directly under ``path`` (empty when it does not exist)."""
        raise NotImplementedError

    def list_stamps(self, path: str) -> dict[str, tuple[int, str]]:
        """Name → (size, change stamp) of the objects directly under ``path``; the stamp
        changes whenever the object is rewritten (mtime locally, ETag on object stores)."""
        raise NotImplementedError

    def remove(self, path: str) -> None:
        """Remove one object; a missing one is not an error."""
        raise NotImplementedError

    def remove_tree(self, path: str) -> None:
        """Remove everything under ``path``; a missing tree is not an error."""
        raise NotImplementedError

    def tree_bytes(self, path: str) -> int:
        """Bytes stored under ``path``."""
        raise NotImplementedError

    def sizes(self, path: str) -> dict[str, int]:
        """Bytes of every object under ``path``, by path (empty where there is none)."""
        raise NotImplementedError

    def persist(self, path: str) -> None:
        """Make everything under ``path`` survive a power loss before a commit names it.

        Nothing to do where a write is durable once acknowledged (S3, GCS)."""

    def zarr_store(self, path: str, read_only: bool) -> zarr.abc.store.Store:
        raise NotImplementedError


class LocalBackend(Backend):
    """A folder on a disk the OS mounts (local or network)."""

    def __init__(self, root: str | Path) -> None:
        self.root = os.path.abspath(os.path.expanduser(str(root)))
        self.url = self.identity = self.root

    def local_path(self, path: str | Sequence[str], exc: BaseException) -> str | None:
        named = getattr(exc, "filename", None)
        if isinstance(named, str) and os.path.isabs(named):
            return named  # the file the OS call failed on (a temporary file, a chunk)
        return path if isinstance(path, str) else None

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_many(self, paths: Sequence[str], threads: int = 8) -> list[bytes | None]:
        def one(path: str) -> bytes | None:
            try:
                return self.read(path)
            except FileNotFoundError:
                return None

        if len(paths) <= 1 or threads <= 1:
            return [one(p) for p in paths]
        # One slice per thread, not one task per path: 200,000 commit records would spend
        # more in futures and locks than in reading.
        size = -(-len(paths) // threads)
        with ThreadPoolExecutor(min(threads, len(paths))) as pool:
            parts = pool.map(lambda i: [one(p) for p in paths[i : i + size]],
                             range(0, len(paths), size))  # fmt: skip
            return [data for part in parts for data in part]

    def write_atomic(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file_atomic(
            path, f"{path}.{int(time.time())}-{uuid.uuid4().hex[:8]}{TEMPORARY}", data
        )
        _fsync(os.path.dirname(path))  # the rename itself (a failure here: written, not sure)

    def put_many(self, folder: str, objects: dict[str, bytes]) -> None:
        for key, data in objects.items():
            path = os.path.join(folder, key)
            try:
                f = open(path, "wb")  # noqa: SIM115
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f = open(path, "wb")  # noqa: SIM115
            with f:
                f.write(data)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def list_dir(self, path: str) -> list[str]:
        try:
            return [e.name for e in os.scandir(path)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_stamps(self, path: str) -> dict[str, tuple[int, str]]:
        out = {}
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(path) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    out[entry.name] = (st.st_size, f"{st.st_mtime_ns}:{st.st_ino}")
        return out

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def tree_bytes(self, path: str) -> int:
        total = 0
        for folder, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(folder, name)).st_size
        return total

    def persist(self, path: str) -> None:
        """fsync every file, then every folder bottom-up, under ``path`` (threads: the
        kernel writes them out side by side).  Without it a power loss could keep the commit
        record and lose a chunk file the record counts on, which would read as fill values."""
        if not os.path.isdir(path):
            raise FileNotFoundError(errno.ENOENT, "no version folder to persist", path)
        files, folders = [], []

        def unlisted(exc: OSError) -> None:
            raise exc  # a folder not listed would go unsynced

        for folder, _, names in os.walk(path, onerror=unlisted):
            folders.append(folder)
            files.extend(os.path.join(folder, n) for n in names)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(_fsync, files))
            list(pool.map(_fsync, reversed(folders)))
        _fsync(os.path.dirname(path))  # the version folder's own entry

    def zarr_store(self, path: str, read_only: bool) -> zarr.abc.store.Store:
        return LocalStore(path, read_only=read_only)


_NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_NO_PERMISSION = (errno.EACCES, errno.EPERM)
# What S3-compatible servers answer when they refuse a request's credentials; s3fs turns a
# 403 into a PermissionError.
_REFUSED = re.compile(
    r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken|"
    r"InvalidClientTokenId|\b403\b|Forbidden"
)


def refused_credentials(exc: BaseException, text: str) -> bool:
    """Whether an object store's error says it refused the credentials (not a lost
    connection, a server error or a missing bucket)."""
    return isinstance(exc, PermissionError) or bool(_REFUSED.search(text))


def nearest_existing(path: str) -> str:
    """``path``, or its nearest parent that exists."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def disk_problem(exc: BaseException, path: str) -> str | None:
    """What a person must fix when a local write failed for want of space, permission or a
    writable file system — with the free space, or the mode and owner of the nearest
    existing part of ``path`` — or None for any other failure."""
    code = getattr(exc, "errno", None)
    if not isinstance(exc, OSError) or code is None:
        return None
    name = errno.errorcode.get(code, str(code))
    here = nearest_existing(path)
    if code in _NO_SPACE:
        try:
            usage = shutil.disk_usage(here)
            room = f"{usage.free / 1e9:.2f} GB free of {usage.total / 1e9:.2f} GB"
        except OSError:
            room = "its free space unknown"
        return (
            f"{_NO_SPACE[code]} ({name}); the file system of {here} has {room}: free space "
            "there (or raise the quota) or put the store on another disk, then run it again"
        )
    if code in _NO_PERMISSION:
        return (
            f"permission denied ({name}); {describe_access(here)}: give this user write "
            "access there or put the store elsewhere, then run it again"
        )
    if code == errno.EROFS:
        return (
            f"read-only file system ({name}) at {here}: remount it read-write or put the "
            "store elsewhere, then run it again"
        )
    return None


def describe_access(path: str) -> str:
    """``path``'s mode and owner, and who this process runs as."""
    import grp
    import pwd
    import stat

    def user(uid: int) -> str:
        with contextlib.suppress(KeyError):
            return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
        return f"uid {uid}"

    def group(gid: int) -> str:
        with contextlib.suppress(KeyError):
            return grp.getgrgid(gid).gr_name
        return str(gid)

    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path} cannot be examined ({exc.strerror})"
    mode = f"{stat.filemode(st.st_mode)} ({st.st_mode & 0o7777:04o})"
    return (
        f"{path} is mode {mode}, owned by {user(st.st_uid)}, group {group(st.st_gid)}; "
        f"this process runs as {user(os.geteuid())}"
    )


def _fsync(path: str) -> None:
    """fsync a file or folder; an error names it (write-back errors such as ENOSPC or EIO
    surface here).  Filesystems that cannot fsync a folder (EINVAL) are taken at their word,
    as PostgreSQL does."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL and os.path.isdir(path):
            return
        raise OSError(exc.errno, f"fsync failed: {exc.strerror}", path) from exc


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
        self.endpoint: str | None = _USERINFO.sub("", endpoint) if endpoint else None
        self.identity = f"{self.url}|{self.endpoint}" if self.endpoint else self.url
        s3 = fsspec.core.split_protocol(url)[0] in ("s3", "s3a")
        # Options of a read that is one GET of the object (see ONE_GET).
        self._one_get: dict[str, Any] = dict(ONE_GET) if s3 else {}
        self._reader: tuple[int, Any] | None = None  # (pid, async filesystem) for zarr

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
    def write_atomic(self, path: str, data: bytes) -> None:
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
        found = self._reader
        if found is None or found[0] != os.getpid():  # a forked child makes its own
            options = {**self._options, **self._one_get, "asynchronous": True}
            fs, _ = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **options)
            found = self._reader = (os.getpid(), fs)
        return found[1]


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


_USERINFO = re.compile(r"(?<=://)[^/\s]*@")  # to the last "@", as urllib splits it


def redact(text: str, options: dict[str, Any] | None = None) -> str:
    """``text`` with every credential value known here (options, ``client_kwargs``, the
    standard AWS variables, and the ``user:password@`` of any URL, such as an endpoint's)
    replaced by ``***``."""
    text = _USERINFO.sub("***@", text)
    options = options or {}
    nested = options.get("client_kwargs") or {}
    values = [options.get(k) for k in _SECRET_OPTIONS] + [nested.get(k) for k in _SECRET_OPTIONS]
    values += [os.environ.get(v) for v in _SECRET_VARIABLES]
    for value in sorted({v for v in values if isinstance(v, str) and len(v) >= 4}, key=len)[::-1]:
        text = text.replace(value, "***")
    return text


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


def open_backend(url: str | Path, storage_options: dict[str, Any] | None = None) -> Backend:
    """The backend for a folder or an fsspec URL."""
    text = str(url)
    if "://" not in text or text.startswith("file://"):
        return LocalBackend(text.removeprefix("file://"))
    return ObjectBackend(text, storage_options)
