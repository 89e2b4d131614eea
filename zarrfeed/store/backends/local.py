"""A store on a disk the OS mounts: atomic writes are a rename, durability an fsync."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from zarrfeed.store.backends.base import Backend

if TYPE_CHECKING:
    import zarr

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

    def write_atomic(self, path: str, data: bytes, parents: bool = True) -> None:
        if parents:
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
        from zarr.storage import LocalStore  # zarr loads with the first array opened

        return LocalStore(path, read_only=read_only)


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
