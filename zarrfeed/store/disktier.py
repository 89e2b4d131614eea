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
count that goes over the budget evicts the least recently used entries (file mtimes are the
clock: a hit touches its file) down to :data:`LOW_WATER` of it.  The background writer counts
once per batch of entries (or every :data:`COUNT_SHARE` of the budget written), not per entry
(the count's lock and file cost more than writing a chunk), and before writing them: a killed
writer leaves the count high, never low.

What is held is remembered in-process (entries this process wrote or found, and an eviction
counter every eviction bumps), so that a read-ahead of chunks the tier already holds looks at
no file (:meth:`DiskTier.lacking`); an entry another process evicted meanwhile is then read as
a miss and fetched again — remembering never serves bytes, only skips a fetch ahead.

``ZARRFEED_DISK_CACHE`` names the base folder (default ``~/.cache/zarrfeed/chunks``) and
``ZARRFEED_DISK_CACHE_GB`` the budget (default 20; 0 turns the tier off).  The tier itself is
the account's folder in it, ``zarrfeed-<uid>``, private like the shared-memory caches
(:mod:`zarrfeed.cachedirs`): made ``0700`` without following links, checked (owner, mode) when
a process opens the tier, files ``0600``; ``ZARRFEED_CACHE_GROUP`` shares it with a group.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import multiprocessing.util
import os
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from zarrfeed import cachedirs, locks
from zarrfeed.eviction import victims
from zarrfeed.processlocal import ProcessLocal
from zarrfeed.store.backends import write_file_atomic

log = logging.getLogger(__name__)

HEADER = struct.Struct("<4sIQ")  # magic, CRC-32 of the payload, payload length
MAGIC = b"ZFT1"
LOW_WATER = 0.9  # an eviction frees down to this share of the budget
READERS = 64  # reader threads per process at most (a read starts only as many as it uses)
WRITERS = 1  # background writer threads per process (measured: 4 slowed a cold read by 20-40 %)
PENDING_BYTES = 256 << 20  # entries on their way to the disk, per process, at most
DEFAULT_GB = 20.0
STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died
COUNT_SHARE = 0.01  # a batch's bytes are counted at least every this share of the budget
KNOWN_MAX = 200_000  # entries remembered per process (about 25 MB); forgotten beyond
_TMP = ".tmp"
_USAGE, _LOCK, _EVICTIONS = "usage", "usage.lock", "evictions"
_SEQUENCE = itertools.count()  # temporary file names: unique within a process with its pid


def tier_base() -> Path:
    found = os.environ.get("ZARRFEED_DISK_CACHE")
    return Path(found) if found else Path.home() / ".cache" / "zarrfeed" / "chunks"


def tier_folder() -> Path:
    """This account's tier (or its group's): ``<base>/zarrfeed-<uid>``."""
    return tier_base() / cachedirs.access().root_name


def tier_budget() -> int:
    return int(float(os.environ.get("ZARRFEED_DISK_CACHE_GB", DEFAULT_GB)) * 1e9)


def open_tier() -> DiskTier | None:
    """The machine's disk tier as the environment sets it; None when turned off."""
    budget = tier_budget()
    return DiskTier(tier_folder(), budget) if budget > 0 else None


class DiskTier:
    """Chunk objects under ``folder`` within ``budget_bytes`` (shared by every process).
    ``folder`` is made if missing and checked as :mod:`zarrfeed.cachedirs` says: a folder
    another account made or linked there is refused with a ConfigError."""

    def __init__(self, folder: str | Path, budget_bytes: int) -> None:
        self.folder = Path(folder)
        self._root = str(self.folder)
        self.budget_bytes = int(budget_bytes)
        self._access = cachedirs.access()
        cachedirs.check_base(self.folder.parent)
        self._access.ensure(self.folder)
        # this process's: reads served and not, torn entries dropped, bytes kept, evictions
        self.hits = self.misses = self.discarded = self.bytes_kept = self.evictions = 0
        # Entries handed to the writers and not yet renamed into place: served from here.
        self._pending: dict[str, bytes] = {}
        self._pending_total = 0
        # Entries this process wrote or found here since the eviction count it last read.
        self._known: set[str] = set()
        self._known_at = self._evictions()
        self._room = threading.Condition()
        self._writers = ProcessLocal(self._start_writers)
        self._readers = ProcessLocal(partial(ThreadPoolExecutor, READERS, "zarrfeed-tier"))
        self._thread_lock = ProcessLocal(threading.Lock)  # a forked child's starts free

    @property
    def capacity_bytes(self) -> int:
        """Bytes of chunks it can hold at once: its whole budget."""
        return self.budget_bytes

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "budget_bytes": self.budget_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["folder"], state["budget_bytes"])

    @staticmethod
    def key(identity: str, path: str) -> str:
        """The entry of object ``path`` of the store ``identity``."""
        return hashlib.blake2b(f"{identity}\0{path}".encode(), digest_size=16).hexdigest()

    def _path(self, key: str) -> str:
        return f"{self._root}/{key[:2]}/{key}"

    def _remember(self, key: str) -> None:
        if len(self._known) >= KNOWN_MAX:
            self._known.clear()
        self._known.add(key)

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
            self._known.discard(key)
            self.misses += 1
            return None
        payload = _verified(data)
        if payload is None:
            log.warning("disk tier: %s is torn or corrupt; removed, fetching it again", path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self._known.discard(key)
            self.discarded += 1
            self.misses += 1
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # most recently used
        self._remember(key)
        self.hits += 1
        return payload

    def lacking(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` whose entries are neither here nor on their way: what a
        read-ahead fetches.  An entry this process wrote or found since the last eviction
        (one small file read tells) is taken as held without looking at its file; the
        others are looked at once.  Not verified: :meth:`get` does that, and reads an entry
        evicted meanwhile as a miss."""
        evictions = self._evictions()
        if evictions != self._known_at:
            self._known.clear()
            self._known_at = evictions
        out = []
        for key in keys:
            if key in self._pending or key in self._known:
                continue
            if os.path.exists(self._path(key)):
                self._remember(key)
            else:
                out.append(key)
        return out

    def get_many(self, keys: Sequence[str], threads: int = 8) -> list[bytes | memoryview | None]:
        """Many entries at once (None where missing), read in ``threads`` threads."""
        if len(keys) <= 1 or threads <= 1:
            return [self.get(k) for k in keys]
        size = -(-len(keys) // threads)  # one slice per thread, not one task per key
        parts = self._readers.get().map(
            lambda i: [self.get(k) for k in keys[i : i + size]], range(0, len(keys), size)
        )
        return [data for part in parts for data in part]

    # writing ---------------------------------------------------------------------------------
    def put(self, key: str, payload: bytes) -> None:
        """Publish an entry: temporary file, rename (no fsync: the header check catches what
        a power loss tore, and the chunk is fetched again); then count its bytes."""
        self.put_batch([(key, payload)])

    def put_batch(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Publish entries as :meth:`put` does, counting their bytes once per
        :data:`COUNT_SHARE` of the budget instead of once per entry.  Bytes are counted
        before their entries are written: a process killed mid-batch (or a failed write)
        leaves the count above what is held, which the next eviction corrects from the
        files, never below it, which would let the tier outgrow its budget."""
        every = max(1, int(self.budget_bytes * COUNT_SHARE))
        start = 0
        while start < len(items):
            stop, size = start, 0
            while stop < len(items) and (stop == start or size < every):
                size += HEADER.size + len(items[stop][1])
                stop += 1
            self._count(size)
            for key, payload in items[start:stop]:
                self._write(key, payload)
            start = stop

    def _write(self, key: str, payload: bytes) -> None:
        """Write one entry into place (its bytes are already counted)."""
        path = self._path(key)
        tmp = f"{self._root}/{key[:2]}/.{key}.{os.getpid()}-{next(_SEQUENCE)}{_TMP}"
        header = HEADER.pack(MAGIC, zlib.crc32(payload), len(payload))
        try:
            write_file_atomic(path, tmp, header, payload, durable=False, opener=self._access.open)
        except FileNotFoundError:  # its subfolder is not made yet (or was cleared)
            with contextlib.suppress(FileExistsError):
                self._access.mkdir(os.path.dirname(path))
            write_file_atomic(path, tmp, header, payload, durable=False, opener=self._access.open)
        self._remember(key)
        self.bytes_kept += len(payload)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Publish entries in the background (a reader does not wait for the disk);
        waits only while :data:`PENDING_BYTES` are already on their way.  Until an entry is
        in place, :meth:`get` serves it from memory."""
        writers = self._writers.get()
        batch: list[tuple[str, bytes]] = []
        for key, payload in items:
            with self._room:
                full = self._pending_total + len(payload) > PENDING_BYTES
            if full and batch:  # hand over what waits here before waiting for room
                writers.submit(self._write_pending, batch)
                batch = []
            with self._room:
                while self._pending and self._pending_total + len(payload) > PENDING_BYTES:
                    self._room.wait()
                if key in self._pending:
                    continue
                self._pending[key] = payload
                self._pending_total += len(payload)
            batch.append((key, payload))
        if batch:
            writers.submit(self._write_pending, batch)

    def _start_writers(self) -> ThreadPoolExecutor:
        """This process's writer threads, with no entries on their way yet (a forked child
        inherits its parent's pending entries, not the threads writing them)."""
        self._pending, self._pending_total = {}, 0
        self._room = threading.Condition()
        # A DataLoader worker leaves through multiprocessing's exit, which skips the
        # interpreter's: the writes still on their way are finished then.
        multiprocessing.util.Finalize(self, self.flush, exitpriority=10)
        return ThreadPoolExecutor(WRITERS, thread_name_prefix="zarrfeed-tier")

    def _write_pending(self, batch: list[tuple[str, bytes]]) -> None:
        try:
            self.put_batch(batch)
        except OSError as exc:  # a cache: the chunks are fetched again next time
            log.warning("disk tier: could not keep chunks in %s (%s)", self.folder, exc)
        finally:
            with self._room:
                for key, payload in batch:
                    if self._pending.pop(key, None) is not None:
                        self._pending_total -= len(payload)
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
        opener = self._access.open
        with self._thread_lock.get(), open(self.folder / _LOCK, "a+b", opener=opener) as lock:
            locks.lock_for_process(lock.fileno())
            yield

    def _count(self, added: int) -> None:
        """Count ``added`` bytes about to be written, evicting first where they would take
        the tier over its budget."""
        with self._locked():
            try:
                held = int((self.folder / _USAGE).read_text()) + added
            except (FileNotFoundError, ValueError):
                held = self._scan_bytes() + added
            if held > self.budget_bytes:
                held = self._evict(max(0, int(self.budget_bytes * LOW_WATER) - added)) + added
                self._evicted()
            self._write_count(_USAGE, held)

    def _write_count(self, name: str, value: int) -> None:
        """Write one of the tier's counts (under the lock), made at the tier's file mode."""
        with open(self.folder / name, "w", opener=self._access.open) as f:
            f.write(str(value))

    def _evictions(self) -> int:
        """How many evictions (and clears) the tier has seen, by any process."""
        try:
            with open(f"{self._root}/{_EVICTIONS}", "rb") as f:
                return int(f.read() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _evicted(self) -> None:
        """Count an eviction (under the lock): every process's remembered entries are
        looked at again."""
        self._write_count(_EVICTIONS, self._evictions() + 1)
        self._known.clear()

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
        entries = self._entries()
        sizes = np.array([size for _, size, _ in entries], np.int64)
        held = int(sizes.sum())
        used = np.array([used for used, _, _ in entries], np.float64)
        chosen = victims(used, held - target, sizes=sizes).tolist()
        for i in chosen:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entries[i][2])
            held -= int(sizes[i])
        self.evictions += len(chosen)
        return held

    def held_bytes(self) -> int:
        """Bytes held now, counted from the files."""
        return self._scan_bytes()

    def stats(self) -> dict[str, int | str]:
        """The entries and bytes held (counted from the files, every process's), and this
        process's hits, misses, bytes kept (``bytes_decoded``: what its misses brought in,
        fetched rather than decoded) and evictions."""
        entries = self._entries()
        return {
            "hits": self.hits,
            "misses": self.misses,
            "bytes_decoded": self.bytes_kept,
            "evictions": self.evictions,
            "discarded": self.discarded,
            "entries": len(entries),
            "bytes_held": sum(size for _, size, _ in entries),
            "budget_bytes": self.budget_bytes,
            "folder": str(self.folder),
        }

    def clear(self) -> None:
        """Remove every entry (readers then fetch from the store again): this process's
        writes still on their way land first, so none is served or written after it."""
        self.flush()
        with self._locked():
            for sub in os.scandir(self.folder):
                if sub.is_dir(follow_symlinks=False):
                    shutil.rmtree(sub.path, ignore_errors=True)
            self._write_count(_USAGE, 0)
            self._evicted()

    def close(self) -> None:
        """Finish this process's writes and stop its threads (started again on next use)."""
        self.flush()
        for pools in (self._writers, self._readers):
            pool = pools.discard()
            if pool is not None:
                pool.shutdown(wait=True)


def _verified(data: bytes) -> memoryview | None:
    """The payload of an entry's bytes if its header and checksum hold, else None."""
    if len(data) < HEADER.size:
        return None
    magic, crc, length = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size :]
    if magic != MAGIC or length != len(payload) or zlib.crc32(payload) != crc:
        return None
    return payload  # a view: no copy of the chunk
