"""A local-disk tier between an object store and RAM: chunk objects fetched from a bucket,
kept in a bounded folder so that the next read of the same chunk costs a local file read.

Keys are a digest of the store's identity and the chunk's full path, which names the asset,
the partition, its committed version, the array and the chunk: versions are immutable and a
rebuild writes a new one, so an entry can never be served for another version or store.

Crash-safe: an entry is written (by a background thread: a reader never waits for the disk,
and meanwhile the entry is served from memory) to a temporary file and renamed into place,
and carries a header (magic, CRC-32 and length of the payload) checked on every read; a torn
or corrupt file — a power loss can leave a renamed entry without its blocks, since entries are
not fsynced — is removed and read as a miss, never served.  Bounded: the bytes held are
counted in a small file under a lock shared by every process on the machine (fork-safe); a
write that takes the count over the budget evicts the least recently used entries (file
mtimes are the clock: a hit touches its file) down to :data:`LOW_WATER` of it.

``ZARRFEED_DISK_CACHE`` names the folder (default ``~/.cache/zarrfeed/chunks``) and
``ZARRFEED_DISK_CACHE_GB`` the budget (default 20; 0 turns the tier off).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import multiprocessing.util
import os
import shutil
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from zarrfeed.store.backends import write_file_atomic

log = logging.getLogger(__name__)

HEADER = struct.Struct("<4sIQ")  # magic, CRC-32 of the payload, payload length
MAGIC = b"ZFT1"
LOW_WATER = 0.9  # an eviction frees down to this share of the budget
WRITERS = 1  # background writer threads per process (measured: 4 slowed a cold read by 20-40 %)
PENDING_BYTES = 256 << 20  # entries on their way to the disk, per process, at most
DEFAULT_GB = 20.0
STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died
_TMP = ".tmp"
_USAGE, _LOCK = "usage", "usage.lock"


def tier_folder() -> Path:
    found = os.environ.get("ZARRFEED_DISK_CACHE")
    return Path(found) if found else Path.home() / ".cache" / "zarrfeed" / "chunks"


def tier_budget() -> int:
    return int(float(os.environ.get("ZARRFEED_DISK_CACHE_GB", DEFAULT_GB)) * 1e9)


def open_tier() -> DiskTier | None:
    """The machine's disk tier as the environment sets it; None when turned off."""
    budget = tier_budget()
    return DiskTier(tier_folder(), budget) if budget > 0 else None


class DiskTier:
    """Chunk objects under ``folder`` within ``budget_bytes`` (shared by every process)."""

    def __init__(self, folder: str | Path, budget_bytes: int) -> None:
        self.folder = Path(folder)
        self.budget_bytes = int(budget_bytes)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = self.discarded = 0  # this process's
        # Entries handed to the writers and not yet renamed into place: served from here.
        self._pending: dict[str, bytes] = {}
        self._room = threading.Condition()
        self._writers: tuple[int, ThreadPoolExecutor] | None = None
        self._readers: tuple[int, ThreadPoolExecutor] | None = None
        self._thread_lock = (os.getpid(), threading.Lock())

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "budget_bytes": self.budget_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["folder"], state["budget_bytes"])

    @staticmethod
    def key(identity: str, path: str) -> str:
        """The entry of object ``path`` of the store ``identity``."""
        return hashlib.blake2b(f"{identity}\0{path}".encode(), digest_size=16).hexdigest()

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / key

    # reading ---------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | memoryview | None:
        """The payload of an entry, or None (absent, or torn/corrupt: then removed)."""
        # Pending first: looked at after a missing file, an entry could have been renamed
        # into place and left the pending ones in between, and been fetched again.
        found = self._pending.get(key)
        if found is not None:
            self.hits += 1
            return found
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.misses += 1
            return None
        payload = _verified(data)
        if payload is None:
            log.warning("disk tier: %s is torn or corrupt; removed, fetching it again", path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self.discarded += 1
            self.misses += 1
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # most recently used
        self.hits += 1
        return payload

    def holds(self, key: str) -> bool:
        """Whether the entry is here or on its way (not verified: :meth:`get` does that)."""
        return key in self._pending or self._path(key).exists()

    def get_many(self, keys: Sequence[str], threads: int = 8) -> list[bytes | memoryview | None]:
        """Many entries at once (None where missing), read in ``threads`` threads."""
        if len(keys) <= 1 or threads <= 1:
            return [self.get(k) for k in keys]
        size = -(-len(keys) // threads)  # one slice per thread, not one task per key
        parts = self._pool("_readers", threads).map(
            lambda i: [self.get(k) for k in keys[i : i + size]], range(0, len(keys), size)
        )
        return [data for part in parts for data in part]

    def _pool(self, name: str, threads: int) -> ThreadPoolExecutor:
        """This process's pool ``name`` (a forked child makes its own)."""
        found = getattr(self, name)
        if found is None or found[0] != os.getpid():
            found = (os.getpid(), ThreadPoolExecutor(threads, thread_name_prefix="zarrfeed-tier"))
            setattr(self, name, found)
        return found[1]

    # writing ---------------------------------------------------------------------------------
    def put(self, key: str, payload: bytes) -> None:
        """Publish an entry: temporary file, rename (no fsync: the header check catches what
        a power loss tore, and the chunk is fetched again); then count its bytes."""
        path = self._path(key)
        tmp = path.with_name(f".{key}.{os.getpid()}-{uuid.uuid4().hex[:8]}{_TMP}")
        header = HEADER.pack(MAGIC, zlib.crc32(payload), len(payload))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, tmp, header, payload, durable=False)
        self._count(HEADER.size + len(payload))

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Publish entries in the background (a reader does not wait for the disk);
        waits only while :data:`PENDING_BYTES` are already on their way.  Until an entry is
        in place, :meth:`get` serves it from memory."""
        if self._writers is None or self._writers[0] != os.getpid():  # or a forked copy's
            self._pending, self._room = {}, threading.Condition()
            # A DataLoader worker leaves through multiprocessing's exit, which skips the
            # interpreter's: the writes still on their way are finished then.
            multiprocessing.util.Finalize(self, self.flush, exitpriority=10)
        writers = self._pool("_writers", WRITERS)
        for key, payload in items:
            with self._room:
                while self._pending and self._pending_bytes() + len(payload) > PENDING_BYTES:
                    self._room.wait()
                if key in self._pending:
                    continue
                self._pending[key] = payload
            writers.submit(self._write_pending, key, payload)

    def _pending_bytes(self) -> int:
        return sum(len(p) for p in self._pending.values())

    def _write_pending(self, key: str, payload: bytes) -> None:
        try:
            self.put(key, payload)
        except OSError as exc:  # a cache: the chunk is fetched again next time
            log.warning("disk tier: could not keep a chunk in %s (%s)", self.folder, exc)
        finally:
            with self._room:
                self._pending.pop(key, None)
                self._room.notify_all()

    def flush(self) -> None:
        """Wait until every entry handed to the writers is in place."""
        with self._room:
            while self._pending:
                self._room.wait()

    # the budget ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The tier's lock, among this process's threads and across processes.  A POSIX
        record lock (``lockf``) belongs to its process — a child forked while a thread held
        it does not inherit it (an ``flock`` would stay held by the child's copy of the
        descriptor, and every process would wait for it forever) — and the thread lock is
        made again in a forked child for the same reason."""
        if self._thread_lock[0] != os.getpid():
            self._thread_lock = (os.getpid(), threading.Lock())
        with self._thread_lock[1], open(self.folder / _LOCK, "a+b") as lock:
            fcntl.lockf(lock, fcntl.LOCK_EX)
            yield

    def _count(self, added: int) -> None:
        with self._locked():
            try:
                held = int((self.folder / _USAGE).read_text()) + added
            except (FileNotFoundError, ValueError):
                held = self._scan_bytes()
            if held > self.budget_bytes:
                held = self._evict(int(self.budget_bytes * LOW_WATER))
            (self.folder / _USAGE).write_text(str(held))

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, bytes, path) of every entry; stale temporary files are removed."""
        found, now = [], time.time()
        for sub in os.scandir(self.folder):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(sub.path):
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat(follow_symlinks=False)
                    if e.name.endswith(_TMP):
                        if now - st.st_mtime > STALE_TMP_S:
                            os.unlink(e.path)
                        continue
                    found.append((st.st_mtime, st.st_size, Path(e.path)))
        return found

    def _scan_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _evict(self, target: int) -> int:
        """Remove least recently used entries until at most ``target`` bytes are held;
        returns the bytes held then."""
        entries = sorted(self._entries())
        held = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if held <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            held -= size
        return held

    def held_bytes(self) -> int:
        """Bytes held now, counted from the files."""
        return self._scan_bytes()

    def stats(self) -> dict[str, int | str]:
        entries = self._entries()
        return {
            "folder": str(self.folder),
            "entries": len(entries),
            "bytes": sum(size for _, size, _ in entries),
            "budget_bytes": self.budget_bytes,
        }

    def clear(self) -> None:
        """Remove every entry (readers then fetch from the store again): this process's
        writes still on their way land first, so none is served or written after it."""
        self.flush()
        with self._locked():
            for sub in os.scandir(self.folder):
                if sub.is_dir(follow_symlinks=False):
                    shutil.rmtree(sub.path, ignore_errors=True)
            (self.folder / _USAGE).write_text("0")


def _verified(data: bytes) -> memoryview | None:
    """The payload of an entry's bytes if its header and checksum hold, else None."""
    if len(data) < HEADER.size:
        return None
    magic, crc, length = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size :]
    if magic != MAGIC or length != len(payload) or zlib.crc32(payload) != crc:
        return None
    return payload  # a view: no copy of the chunk
