"""Whole decoded arrays in shared memory, one copy per machine: the cache of a dataset that fits
its budget (decoded once, before the workers start, then only read).

Entries are ``.npy`` files in a RAM-backed folder that every process maps read-only with its
pages mapped up front (``MAP_POPULATE``), so DataLoader workers — forked, forkserver'd or
spawned — and DDP ranks on one machine share one copy.  What the kernel holds is what counts:

* the budget covers entries and fills in progress (a fill reserves its full size first);
* an entry is evicted (least recently used first) by unlinking it and bumping an eviction
  epoch in the shared statistics; every process drops its mappings of unlinked entries the
  next time it reads the cache, so their pages are freed instead of living on in old mappings;
* a fill holds a kernel-released lock on its entry (:mod:`~zarrfeed.locks`):
  a concurrent miss of the same key waits for it, and a writer killed mid-fill frees the key
  at once — its half-written file is removed by the next writer of that key or by eviction.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zarrfeed import locks
from zarrfeed.eviction import victims
from zarrfeed.processlocal import ProcessLocal
from zarrfeed.training.data.shm import CacheFolder, attach_lock, reserve
from zarrfeed.training.data.stats import StatsTable

log = logging.getLogger("zarrfeed.training")

STAT_ROWS = 512  # the totals row, then one per process (reused once its process is gone)
COLUMNS = ("hits", "misses", "bytes_decoded", "evictions")
EPOCH = "eviction epoch"  # a cell every eviction bumps: others drop their mappings
INDEX_LOCK = 0  # byte of the locks file guarding eviction and reservations
STATS_LOCK = 1 + (1 << 48)  # byte guarding the statistics' rows (past every entry's byte)


@dataclass(frozen=True)
class Fill:
    """An entry decoded in place: its shape and dtype, known before decoding, and a function
    that writes the array into the buffer it is given."""

    shape: tuple[int, ...]
    dtype: np.dtype
    into: Callable[[np.ndarray], object]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class SharedArrayCache:
    """Arrays by key, shared through a RAM-backed folder, within ``budget_bytes``.

    ``name`` picks the folder (callers put the store's identity in it); keys name the bytes
    (callers put the partition's version in them).
    """

    def __init__(self, name: str, budget_bytes: int, meta: dict[str, Any] | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.name, self.budget_bytes = name, int(budget_bytes)
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        self._meta = {"store": name, **(meta or {}), "budget_bytes": self.budget_bytes}
        self._dir = CacheFolder("arrays", digest, self._meta)
        self.folder = self._dir.path
        # this process's mappings and descriptors, made when it first uses the cache
        self._local = ProcessLocal(self._open_here, self._forget_parent, attach_lock)

    @property
    def capacity_bytes(self) -> int:
        """Bytes of arrays it can hold at once: its whole budget."""
        return self.budget_bytes

    # pickling and fork: only the name and budget travel; handles are per process ---------
    def __getstate__(self) -> dict:
        keep = ("name", "budget_bytes", "_meta", "_dir", "folder", "_local")
        return {k: self.__dict__[k] for k in keep}

    def _open_here(self) -> dict[int, threading.Thread]:
        """Open the folder in this process: its descriptors of the locks file (one per
        thread) start empty, and so do its mappings."""
        self._mapped: dict[str, np.ndarray] = {}  # read-only views, as callers get them
        self._tensors: dict[str, torch.Tensor] = {}  # the same pages, for fast strided copies
        self._paths: dict[str, str] = {}
        self._stats: StatsTable | None = None
        self._epoch = 0
        self._tls = threading.local()
        self._fds: dict[int, threading.Thread] = {}  # each thread's open of the locks file
        self._warned: set[str] = set()
        self._dir.open(self.budget_bytes)
        return self._fds

    def _forget_parent(self, fds: dict[int, threading.Thread]) -> None:
        """Forked: the mappings are inherited, the descriptors are not ours."""
        self._dir.forget()
        for fd in fds:  # copies of the parent's opens: a lock held through them
            os.close(fd)  # must not outlive the parent

    def _open(self) -> None:
        self._local.get()

    def close(self) -> None:
        """Drop this process's mappings and its hold on the folder (reopened on next use)."""
        with attach_lock():
            if self._local.discard() is not None:
                self._release()

    def __del__(self) -> None:
        # Dropped without close() (a dataset gone out of scope): its descriptors go, and its
        # hold on the folder, which would keep any sweep from removing it.  Not through
        # close(): the collector may run this inside attach_lock.
        with contextlib.suppress(Exception):  # at interpreter exit, modules may be gone
            if self._local.peek() is not None:
                self._release()

    def _release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = {}
        self._mapped.clear()
        self._tensors.clear()
        self._dir.close()

    def _fd(self) -> int:
        """This thread's own open of the locks file (locks are per open, see locks.py)."""
        fd = getattr(self._tls, "fd", None)
        if fd is None:
            with attach_lock():
                path, flags = self.folder / "locks", os.O_RDWR | os.O_CREAT
                fd = locks.open_for_thread(path, flags, self._fds, self._dir.access.open)
            self._tls.fd = fd
        return fd

    # statistics ------------------------------------------------------------------------------
    def _stat_table(self) -> StatsTable:
        if self._stats is None:
            path, size = self.folder / ".stats", StatsTable.nbytes(COLUMNS, STAT_ROWS, (EPOCH,))
            with self._locked():
                if not path.exists() or path.stat().st_size != size:
                    with open(path, "wb", opener=self._dir.access.open) as f:
                        np.zeros(size // 8, dtype=np.int64).tofile(f)
                words = np.memmap(path, dtype=np.int64, mode="r+", shape=(size // 8,))
            rows = functools.partial(self._locked, STATS_LOCK)  # counts come under INDEX_LOCK too
            self._stats = StatsTable(words, COLUMNS, STAT_ROWS, rows, (EPOCH,))
        return self._stats

    def _count(self, column: str, n: int = 1) -> None:
        self._stat_table().add(column, n)

    def stats(self) -> dict[str, int | float]:
        """Hits, misses, bytes decoded, evictions (all processes), entries and bytes held."""
        self._open()
        totals = self._stat_table().totals()
        entries = [e for e in self._entries() if e[0].suffix == ".npy"]
        lookups = totals["hits"] + totals["misses"]
        return {
            **totals,
            "hit_rate": totals["hits"] / lookups if lookups else 0.0,
            "entries": len(entries),
            "bytes_held": sum(size for _, size, _ in entries),
            "budget_bytes": self.budget_bytes,
        }

    # the cache ---------------------------------------------------------------------------------
    def _digest(self, key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    def _path(self, key: str) -> Path:
        return self.folder / f"{self._digest(key)}.npy"

    def lookup(self, key: str, reads: int = 1) -> np.ndarray | None:
        """The cached array for ``key`` if this process has it mapped and it is still
        there (the hot path: no hashing, one ``utime`` for the LRU clock), else None;
        ``reads`` is how many reads it serves (the hits counted)."""
        if self._local.peek() is None:
            return None
        arr = self._mapped.get(key)
        if arr is None:
            return None
        self._drop_evicted()
        try:
            os.utime(self._paths[key])
        except (FileNotFoundError, KeyError):
            self._forget(key)
            return None
        if reads:
            self._count("hits", reads)
        return arr

    def tensor(self, key: str, reads: int = 1) -> torch.Tensor | None:
        """:meth:`lookup` as a tensor over the same pages: torch copies 3-D strided regions
        (a patch out of a volume) about 1.5x faster than numpy."""
        return None if self.lookup(key, reads) is None else self._tensors[key]

    def _keep(self, key: str, path: Path, mapped: np.ndarray) -> np.ndarray:
        view = mapped.view()
        view.flags.writeable = False  # callers read; the pages are everyone's
        self._mapped[key], self._tensors[key] = view, torch.from_numpy(mapped)
        self._paths[key] = str(path)
        return view

    def _forget(self, key: str) -> None:
        self._mapped.pop(key, None)
        self._tensors.pop(key, None)

    @staticmethod
    def _lock_byte(digest: str) -> int:
        return 1 + int(digest[:12], 16)  # one byte per entry; 0 is the index lock

    def get(
        self, key: str, load: Callable[[], np.ndarray] | Fill, wait: bool = True
    ) -> np.ndarray | None:
        """The cached array for ``key`` (read-only), decoding it with ``load`` on a miss.

        With ``wait=False``, a key that another process is decoding right now returns None
        at once, so the caller can read just the piece it needs meanwhile.
        """
        self._open()
        self._drop_evicted()
        path = self._path(key)
        arr = self._mapped.get(key)
        try:
            os.utime(path)  # LRU clock; raises if the entry was evicted
            if arr is None:
                arr = self._keep(key, path, _map_npy(path))
            self._count("hits")
            return arr
        except FileNotFoundError:
            self._forget(key)
        return self._miss(key, path, load, wait)

    def _miss(
        self, key: str, path: Path, load: Callable[[], np.ndarray] | Fill, wait: bool
    ) -> np.ndarray | None:
        fd, byte = self._fd(), self._lock_byte(self._digest(key))
        if not locks.lock(fd, byte, wait=False):  # another process is decoding this key
            if not wait:
                self._count("misses")
                return None
            locks.lock(fd, byte)  # returns when that writer is done — or dead
        try:
            if path.exists():  # the other writer finished it
                return self.get(key, load)
            for stale in self.folder.glob(f"{path.stem}.*.tmp"):  # a dead writer's leftover
                stale.unlink(missing_ok=True)
            fill = load if isinstance(load, Fill) else None
            data = None if fill else np.ascontiguousarray(load())
            nbytes = fill.nbytes if fill else data.nbytes
            self._count("misses")
            self._count("bytes_decoded", nbytes)
            if nbytes > self.budget_bytes:  # larger than the whole budget: serve it uncached
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning(
                        "%s: %.2f GB is more than the whole cache budget (%.2f GB): "
                        "read without caching",
                        key,
                        nbytes / 1e9,
                        self.budget_bytes / 1e9,
                    )
                if fill is None:
                    return data
                out = np.empty(fill.shape, fill.dtype)
                fill.into(out)
                return out
            tmp = path.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")
            with self._locked():  # reserve: the tmp file's size counts from now on
                self._evict(self.budget_bytes - nbytes)
                with open(tmp, "wb", opener=self._dir.access.open) as f:
                    if fill is None:
                        np.save(f, data)
                    else:  # the .npy header, then the data's size (filled in place below)
                        header = {
                            "descr": np.lib.format.dtype_to_descr(np.dtype(fill.dtype)),
                            "fortran_order": False,
                            "shape": tuple(fill.shape),
                        }
                        np.lib.format.write_array_header_1_0(f, header)
                        f.flush()
                        reserve(f.fileno(), f.tell(), fill.nbytes, tmp)
            try:
                if fill is not None:
                    arr = _map_npy(tmp)  # this mapping stays: its pages are mapped
                    fill.into(arr)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return self._keep(key, path, arr if fill is not None else _map_npy(path))
        finally:
            locks.unlock(fd, byte)

    def _entries(self) -> Iterator[tuple[Path, int, float]]:
        """Entries and fills in progress (``.tmp``): (path, size, last use)."""
        for entry in os.scandir(self.folder):
            if entry.name.endswith((".npy", ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    yield Path(entry.path), st.st_size, st.st_mtime

    def _evict(self, keep_bytes: int) -> None:
        """Remove leftovers of dead writers, then least-recently-used entries until at most
        ``keep_bytes`` remain (under the index lock)."""
        fd, entries, evicted = self._fd(), [], False
        for path, size, used in self._entries():
            if path.suffix == ".tmp" and not locks.held_by_other(
                fd, self._lock_byte(path.name.split(".")[0])
            ):
                path.unlink(missing_ok=True)  # no live writer holds its key
                continue
            entries.append((path, size, used))
        sizes = np.array([size for _, size, _ in entries], np.int64)
        need = int(sizes.sum()) - keep_bytes
        writing = np.array([path.suffix == ".tmp" for path, _, _ in entries], bool)
        used = np.array([used for _, _, used in entries], np.float64)
        for i in victims(used, need, sizes=sizes, protected=writing).tolist():
            with contextlib.suppress(FileNotFoundError):
                entries[i][0].unlink()
                evicted = True
                self._count("evictions")
        if evicted:
            self._stat_table().bump(EPOCH)  # the eviction epoch: others drop their mappings

    def _drop_evicted(self) -> None:
        epoch = self._stat_table().cell(EPOCH)
        if epoch != self._epoch:
            self._epoch = epoch
            for key in [k for k in self._mapped if not self._path(k).exists()]:
                self._forget(key)

    def drop_others(self, keep: set[str]) -> None:
        """Evict every entry whose key is not in ``keep`` (old commits of the same data)."""
        self._open()
        wanted = {f"{self._digest(k)}.npy" for k in keep}
        with self._locked():
            gone = [p for p, _, _ in self._entries() if p.suffix == ".npy" and p.name not in wanted]
            for path in gone:
                path.unlink(missing_ok=True)
                self._count("evictions")
            if gone:
                self._stat_table().bump(EPOCH)

    @contextlib.contextmanager
    def _locked(self, byte: int = INDEX_LOCK) -> Iterator[None]:
        fd = self._fd()
        locks.lock(fd, byte)
        try:
            yield
        finally:
            locks.unlock(fd, byte)

    def clear(self) -> None:
        """Drop every entry and the statistics (other processes drop their mappings)."""
        self._open()
        with self._locked():
            for path, _, _ in list(self._entries()):
                if path.suffix == ".npy":
                    path.unlink(missing_ok=True)
            table = self._stat_table()
            table.reset()
            table.bump(EPOCH)
        self._mapped.clear()
        self._tensors.clear()


# numpy parses a .npy header with ast.literal_eval, and CPython 3.11's AST constructor is not
# thread-safe: two parses at once can fail with "SystemError: AST constructor recursion depth
# mismatch" (python/cpython#106905; seen here when the preload's threads map files at once).
_HEADER_LOCK = threading.Lock()


def _map_npy(path: Path) -> np.ndarray:
    """A ``.npy`` file mapped whole, shared, with its pages mapped up front (``MAP_POPULATE``):
    one call instead of a page fault per 4 KiB on first touch (~2 µs each, 50 ms per 110 MB).
    Mapped writable (callers get read-only views) so that torch can view it without copies."""
    with open(path, "r+b") as f:
        version = np.lib.format.read_magic(f)
        read_header = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }[version]
        with _HEADER_LOCK:
            shape, fortran, dtype = read_header(f)
        offset = f.tell()
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(f.fileno(), 0, flags=flags, prot=prot)
    return np.ndarray(shape, dtype, buffer=mapped, offset=offset, order="F" if fortran else "C")
