"""A fixed shared-memory arena of equal slots, each holding one decoded chunk: the cache of a
dataset larger than its budget.

One file in a RAM-backed folder, exactly as large as the budget, holds everything — so the
shared memory the kernel counts for the cache can never exceed it, however many processes
map it.  Its layout::

    header | per-process statistics | per-slot key (128 bits), generation, last use
           | hash table (key → slot, linear probing) | slots

Readers take no lock.  A slot's *generation* is odd while it is being (re)written and even
when stable (a seqlock): a reader checks the generation and the key, copies, and keeps the
copy only if the generation did not move meanwhile — so it never keeps bytes that another
process was overwriting, and never bytes of another key.  (x86-64 keeps stores and loads in
order; on other CPUs readers also take the slot's shared lock while copying.)

Writers claim slots under the index lock (least recently used first, sampled on large
arenas), then decode into them holding each slot's own lock.  Both are kernel-released
byte-range locks on the arena file (:mod:`~zarrfeed.locks`): a reader that
finds a slot being filled waits on its lock and is woken the moment the writer finishes or
dies; a dead writer's slot (odd generation, lock free) is freed by whoever sees it, and an
index left half-updated by a writer killed under the index lock is rebuilt from the slots by
the next one to take it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from zarrfeed import locks
from zarrfeed.eviction import victims
from zarrfeed.processlocal import ProcessLocal
from zarrfeed.training.data.shm import CacheFolder, attach_lock, reserve
from zarrfeed.training.data.stats import StatsTable

Key = tuple[int, int]

MAGIC = 0x31414E4552414652  # "RFARENA1"
HEADER = 4096
STAT_ROWS = 256  # the totals row, then one per process (reused once its process is gone)
COLUMNS = ("hits", "misses", "bytes_decoded", "evictions", "waits")
STATS_BYTES = StatsTable.nbytes(COLUMNS, STAT_ROWS)
H_MAGIC, H_SLOTS, H_SLOT_BYTES, H_TABLE, H_DIRTY = range(5)
META_PER_SLOT = 4 * 8 + 2 * 8  # key hi, key lo, generation, last use; two table buckets
INDEX_LOCK = 0  # byte 0; slot s is byte 1 + s
SAMPLE = 4096  # arenas larger than this pick victims among a random sample of slots
MASK = (1 << 64) - 1
ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def geometry(budget_bytes: int, slot_bytes: int) -> tuple[int, int, int, int]:
    """(slots, hash-table buckets, offset of the slot metadata, offset of the slots) of an
    arena file of at most ``budget_bytes``."""
    fixed = HEADER + STATS_BYTES
    slots = max(0, (budget_bytes - fixed - mmap.PAGESIZE) // (slot_bytes + META_PER_SLOT))
    buckets = 1 << max(1, (2 * slots - 1).bit_length())
    while slots and _data_offset(fixed, slots, buckets) + slots * slot_bytes > budget_bytes:
        slots -= 1
        buckets = 1 << max(1, (2 * slots - 1).bit_length())
    return slots, buckets, fixed, _data_offset(fixed, slots, buckets)


def _data_offset(fixed: int, slots: int, buckets: int) -> int:
    end = fixed + 4 * 8 * slots + 8 * buckets
    return -(-end // mmap.PAGESIZE) * mmap.PAGESIZE


def slot_size(nbytes: int) -> int:
    """Slots are whole pages (whole cache lines for small units)."""
    align = mmap.PAGESIZE if nbytes >= mmap.PAGESIZE else 64
    return -(-nbytes // align) * align


class ChunkArena:
    """``budget_bytes`` of shared memory as slots of ``slot_bytes``, keyed by 128-bit keys."""

    def __init__(self, folder: CacheFolder, budget_bytes: int, slot_bytes: int) -> None:
        self.folder, self.budget_bytes = folder, int(budget_bytes)
        self.slot_bytes = slot_size(slot_bytes)
        self.slots, self.buckets, self._meta_at, self._data_at = geometry(
            self.budget_bytes, self.slot_bytes
        )
        self.file_bytes = self._data_at + self.slots * self.slot_bytes
        self.ordered = ORDERED
        # this process's mapping and descriptors (of the arena file, one per thread)
        self._attached = ProcessLocal(self._attach, self._forget_parent, attach_lock)

    @property
    def capacity_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def __getstate__(self) -> dict:
        keep = (
            "folder",
            "budget_bytes",
            "slot_bytes",
            "slots",
            "buckets",
            "_meta_at",
            "_data_at",
            "file_bytes",
            "ordered",
            "_attached",
        )
        return {k: self.__dict__[k] for k in keep}

    # opening ----------------------------------------------------------------------------------
    def _ensure(self) -> None:
        self._attached.get()

    def _forget_parent(self, fds: dict[int, threading.Thread]) -> None:
        """Forked: the parent's descriptors and locks are not ours."""
        self.folder.forget()
        for fd in fds:  # copies of the parent's opens: a lock held through them
            os.close(fd)  # must not outlive the parent

    def _attach(self) -> dict[int, threading.Thread]:
        """Map the arena in this process (creating it if it does not exist yet); its
        descriptors."""
        self.folder.open(self.file_bytes)
        self._tls = threading.local()
        self._hint: dict[Key, int] = {}
        self._views: dict[tuple[int, str, tuple[int, ...]], np.ndarray] = {}
        path = self.folder.path / "arena"
        self._fds: dict[int, threading.Thread] = {}  # each thread's open of the arena file
        opener = self.folder.access.open
        fd = self._tls.fd = locks.open_for_thread(path, os.O_RDWR | os.O_CREAT, self._fds, opener)
        locks.lock(fd, INDEX_LOCK)
        try:
            head = os.pread(fd, 8 * 5, 0)
            fields = np.frombuffer(head, np.uint64) if len(head) == 40 else None
            expected = [MAGIC, self.slots, self.slot_bytes, self.buckets]
            if fields is None or [int(v) for v in fields[:4]] != expected:
                os.ftruncate(fd, 0)  # never a valid arena of this geometry: start empty
                # The whole budget, allocated once: faster than a page fault per 4 KiB of
                # every first fill, what the kernel counts from now on is the budget, and a
                # full /dev/shm is an error here rather than a SIGBUS in a worker later.
                reserve(fd, 0, self.file_bytes, path)
                os.pwrite(fd, np.array(expected[1:], np.uint64).tobytes(), 8)
                os.pwrite(fd, np.array([MAGIC], np.uint64).tobytes(), 0)
        finally:
            locks.unlock(fd, INDEX_LOCK)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(fd, self.file_bytes, flags=flags)
        mv = memoryview(self._mm)
        n, at = self.slots, self._meta_at
        self._head = mv[:HEADER].cast("Q")
        self._stats = StatsTable(mv[HEADER : HEADER + STATS_BYTES], COLUMNS, STAT_ROWS, self._index)
        self._key_hi = mv[at : at + 8 * n].cast("Q")
        self._key_lo = mv[at + 8 * n : at + 16 * n].cast("Q")
        self._gen = mv[at + 16 * n : at + 24 * n].cast("Q")
        self._used = mv[at + 24 * n : at + 32 * n].cast("Q")
        self._table = mv[at + 32 * n : at + 32 * n + 8 * self.buckets].cast("Q")
        self._hi_np = np.frombuffer(self._mm, np.uint64, n, at)
        self._lo_np = np.frombuffer(self._mm, np.uint64, n, at + 8 * n)
        self._gen_np = np.frombuffer(self._mm, np.uint64, n, at + 16 * n)
        self._used_np = np.frombuffer(self._mm, np.uint64, n, at + 24 * n)
        self._data = np.frombuffer(self._mm, np.uint8, n * self.slot_bytes, self._data_at)
        self._data = self._data.reshape(n, self.slot_bytes)
        self._rng = np.random.default_rng()
        return self._fds

    def close(self) -> None:
        """Unmap the arena and release this process's hold on it (a later use maps it again)."""
        with attach_lock():
            if self._attached.peek() is not None:
                self._detach()

    def __del__(self) -> None:
        # Dropped without close() (a dataset gone out of scope): its descriptors and mapping
        # go, and its hold on the folder, which would keep any sweep from removing it.
        with contextlib.suppress(Exception):  # at interpreter exit, modules may be gone
            if self._attached.peek() is not None:
                self._detach()

    def _detach(self) -> None:
        self._stats.release()
        for name in ("_head", "_key_hi", "_key_lo", "_gen", "_used", "_table"):
            getattr(self, name).release()
        self._gen_np = self._used_np = self._hi_np = self._lo_np = self._data = None
        self._views.clear()
        with contextlib.suppress(BufferError):  # a view someone still holds keeps it mapped
            self._mm.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = {}
        self._attached.discard()
        self.folder.close()

    def _fd(self) -> int:
        """This thread's own open of the arena file (locks are per open, see locks.py)."""
        fd = getattr(self._tls, "fd", None)
        if fd is None:
            with attach_lock():
                path, opener = self.folder.path / "arena", self.folder.access.open
                fd = locks.open_for_thread(path, os.O_RDWR, self._fds, opener)
            self._tls.fd = fd
        return fd

    # the index --------------------------------------------------------------------------------
    def _bucket(self, hi: int, lo: int) -> int:
        return (((hi ^ lo) * 0x9E3779B97F4A7C15) & MASK) & (self.buckets - 1)

    def _find(self, hi: int, lo: int) -> int:
        """The slot indexed under the key, or -1 (lock-free: callers validate the slot)."""
        table, key_hi, key_lo, mask = self._table, self._key_hi, self._key_lo, self.buckets - 1
        i = self._bucket(hi, lo)
        for _ in range(self.buckets):
            s = table[i] - 1
            if s < 0:
                return -1
            if s < self.slots and key_hi[s] == hi and key_lo[s] == lo:
                return s
            i = (i + 1) & mask
        return -1

    def _insert(self, s: int) -> None:
        i, mask = self._bucket(self._key_hi[s], self._key_lo[s]), self.buckets - 1
        while self._table[i]:
            i = (i + 1) & mask
        self._table[i] = s + 1

    def _unindex(self, s: int) -> None:
        """Remove slot ``s`` from the table (backward-shift deletion, no tombstones)."""
        mask = self.buckets - 1
        i = self._bucket(self._key_hi[s], self._key_lo[s])
        while self._table[i] != s + 1:
            if not self._table[i]:
                return
            i = (i + 1) & mask
        j = i
        while True:
            self._table[i] = 0
            while True:
                j = (j + 1) & mask
                t = self._table[j]
                if not t:
                    return
                k = self._bucket(self._key_hi[t - 1], self._key_lo[t - 1])
                if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
                    continue  # its home lies between: it stays
                break
            self._table[i] = t
            i = j

    @contextlib.contextmanager
    def _index(self) -> Iterator[int]:
        """Hold the index lock; rebuild the index first if its last holder died in it."""
        fd = self._fd()
        locks.lock(fd, INDEX_LOCK)
        try:
            if self._head[H_DIRTY]:
                self._rebuild(fd)
            self._head[H_DIRTY] = 1
            yield fd
            self._head[H_DIRTY] = 0
        finally:
            locks.unlock(fd, INDEX_LOCK)

    def _rebuild(self, fd: int) -> None:
        """Free slots whose writer died, then index every slot that holds a key."""
        for s in np.flatnonzero(self._gen_np & 1).tolist():
            if not locks.held_by_other(fd, 1 + s):
                self._key_hi[s] = self._key_lo[s] = self._used[s] = 0
                self._gen[s] += 1
        for i in range(self.buckets):
            self._table[i] = 0
        for s in range(self.slots):
            if self._key_hi[s] or self._key_lo[s]:
                self._insert(s)

    # reading ----------------------------------------------------------------------------------
    def view(self, s: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Slot ``s`` as an array of ``shape`` (a unit's shape; views are kept per process)."""
        key = (s, dtype.str, shape)
        v = self._views.get(key)
        if v is None:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            v = self._views[key] = self._data[s, :nbytes].view(dtype).reshape(shape)
        return v

    def copy(
        self, key: Key, dtype: np.dtype, shape: tuple[int, ...], src: tuple, dst: np.ndarray
    ) -> int:
        """Copy ``view[src]`` of the slot holding ``key`` into ``dst``: 1 when done, 0 when
        the key is absent, ``-1 - slot`` while another process fills it."""
        self._ensure()
        hi, lo = key
        key_hi, key_lo, gen = self._key_hi, self._key_lo, self._gen
        s = self._hint.get(key, -1)
        if s < 0 or key_hi[s] != hi or key_lo[s] != lo:
            s = self._find(hi, lo)
            if s < 0:
                return 0
        g = gen[s]
        if g & 1:
            return -1 - s
        if key_hi[s] != hi or key_lo[s] != lo:
            return 0
        if self.ordered:
            np.copyto(dst, self.view(s, dtype, shape)[src])
        else:
            fd = self._fd()
            locks.lock(fd, 1 + s, exclusive=False)
            try:
                np.copyto(dst, self.view(s, dtype, shape)[src])
            finally:
                locks.unlock(fd, 1 + s)
        if gen[s] != g:  # rewritten while we copied: what we copied is not kept
            return 0
        self._used[s] = time.monotonic_ns()
        if len(self._hint) > 4 * self.slots:  # keys long evicted: start the hints afresh
            self._hint.clear()
        self._hint[key] = s
        return 1

    def copy_many(
        self,
        keys: Sequence[Key],
        dtype: np.dtype,
        shape: tuple[int, ...],
        srcs: Sequence[tuple],
        dsts: Sequence[np.ndarray],
    ) -> list[int]:
        """:meth:`copy` of many pieces at once (``view[srcs[i]]`` of the slot holding
        ``keys[i]`` into ``dsts[i]``): the positions of those not copied (absent, being filled,
        or rewritten meanwhile).  The seqlock is checked for all of them together — one read
        of the generations before the copies, one after — and the LRU clock set once."""
        self._ensure()
        if not self.ordered:  # each copy under its slot's shared lock
            return [
                i
                for i, key in enumerate(keys)
                if self.copy(key, dtype, shape, srcs[i], dsts[i]) != 1
            ]
        hint, key_hi, key_lo = self._hint, self._key_hi, self._key_lo
        slots = []
        for key in keys:
            s = hint.get(key, -1)
            if s < 0 or key_hi[s] != key[0] or key_lo[s] != key[1]:
                s = self._find(*key)
            slots.append(s)
        at = np.array(slots, np.int64)
        found = at >= 0
        where = np.where(found, at, 0)
        before = self._gen_np[where]
        hi = np.fromiter((k[0] for k in keys), np.uint64, len(keys))
        lo = np.fromiter((k[1] for k in keys), np.uint64, len(keys))
        # stable (even), and still this key once the generation was read
        ok = found & ((before & 1) == 0) & (self._hi_np[where] == hi) & (self._lo_np[where] == lo)
        view = self.view
        for i in np.flatnonzero(ok).tolist():
            np.copyto(dsts[i], view(slots[i], dtype, shape)[srcs[i]])
        ok &= self._gen_np[where] == before  # rewritten while we copied: not kept
        done = np.flatnonzero(ok)
        if len(done):
            self._used_np[where[done]] = time.monotonic_ns()
            if len(hint) > 4 * self.slots:  # keys long evicted: start the hints afresh
                hint.clear()
            hint.update((keys[i], slots[i]) for i in done.tolist())
        return np.flatnonzero(~ok).tolist()

    def touch(self, keys: Sequence[Key]) -> None:
        """Mark resident ``keys`` as just used (the LRU clock)."""
        self._ensure()
        now = time.monotonic_ns()
        for key in keys:
            s = self._find(*key)
            if s >= 0:
                self._used[s] = now

    def holds(self, key: Key) -> bool:
        """Whether ``key`` is resident or being filled."""
        self._ensure()
        return self._find(*key) >= 0

    def wait(self, key: Key, s: int) -> None:
        """Wait until slot ``s`` is no longer being filled; free it if its writer died."""
        self._ensure()
        fd = self._fd()
        locks.lock(fd, 1 + s, exclusive=False)  # granted when the writer finishes or dies
        locks.unlock(fd, 1 + s)
        self.count("waits", 1)
        if self._gen[s] & 1 and (self._key_hi[s], self._key_lo[s]) == key:
            with self._index():
                if self._gen[s] & 1 and not locks.held_by_other(fd, 1 + s):
                    self._unindex(s)
                    self._key_hi[s] = self._key_lo[s] = self._used[s] = 0
                    self._gen[s] += 1

    # writing ----------------------------------------------------------------------------------
    def claim(self, keys: Sequence[Key]) -> tuple[list[tuple[Key, int]], list[tuple[Key, int]]]:
        """Slots to fill for the ``keys`` nobody holds: (claimed, busy).

        Claimed slots are locked by this thread and marked as being written: fill each with
        :meth:`view`, then :meth:`publish` them (or :meth:`abandon` them on failure).  Busy
        ones are being filled by someone else (:meth:`wait` on them).  Keys already present,
        or for which no slot could be freed, are in neither list: read them again.
        """
        self._ensure()
        claimed: list[tuple[Key, int]] = []
        busy: list[tuple[Key, int]] = []
        with self._index() as fd:
            need = []
            for key in dict.fromkeys(keys):
                s = self._find(*key)
                if s < 0:
                    need.append(key)
                elif self._gen[s] & 1:
                    busy.append((key, s))
            now, evicted = time.monotonic_ns(), 0
            for key, s in zip(need, self._victims(len(need)), strict=False):
                if self._key_hi[s] or self._key_lo[s]:
                    self._unindex(s)
                    evicted += 1
                locks.lock(fd, 1 + s)
                self._gen[s] += 1  # odd: being written
                self._key_hi[s], self._key_lo[s] = key
                self._used[s] = now
                self._insert(s)
                claimed.append((key, s))
        self.count("evictions", evicted)
        return claimed, busy

    def _victims(self, n: int) -> list[int]:
        """Up to ``n`` slots not being written, least recently used first (free ones are)."""
        if not n or not self.slots:
            return []
        sample = max(SAMPLE, 64 * n) if self.slots > SAMPLE else None
        writing = (self._gen_np & 1) == 1
        return victims(self._used_np, n, protected=writing, sample=sample, rng=self._rng).tolist()

    def publish(self, claimed: Sequence[tuple[Key, int]]) -> None:
        """Make filled slots readable and release them."""
        fd = self._fd()
        for _, s in claimed:
            self._gen[s] += 1  # even: stable
            locks.unlock(fd, 1 + s)

    def abandon(self, claimed: Sequence[tuple[Key, int]]) -> None:
        """Give claimed slots back empty (their fill failed)."""
        fd = self._fd()
        with self._index():
            for _, s in claimed:
                self._unindex(s)
                self._key_hi[s] = self._key_lo[s] = self._used[s] = 0
                self._gen[s] += 1
        for _, s in claimed:
            locks.unlock(fd, 1 + s)

    # statistics and housekeeping --------------------------------------------------------------
    def count(self, column: str, n: int) -> None:
        """Add to this process's count of ``column`` (one of :data:`COLUMNS`)."""
        if n:
            self._ensure()
            self._stats.add(column, n)

    def stats(self) -> dict[str, int]:
        """Hits, misses, bytes decoded, evictions and waits (every process's), the slots
        holding a unit, and the bytes they hold."""
        self._ensure()
        stable = (self._gen_np & 1) == 0
        keyed = (self._hi_np != 0) | (self._lo_np != 0)
        entries = int(np.count_nonzero(keyed & stable))
        return {
            **self._stats.totals(),
            "entries": entries,
            "bytes_held": entries * self.slot_bytes,
            "budget_bytes": self.budget_bytes,
            "slots": self.slots,
        }

    def clear(self) -> None:
        """Forget every stable slot and the statistics (fills in progress finish normally)."""
        self._ensure()
        with self._index():
            for s in range(self.slots):
                if not self._gen[s] & 1:
                    self._key_hi[s] = self._key_lo[s] = self._used[s] = 0
                    self._gen[s] += 2  # moves: a reader copying now discards its copy
            for i in range(self.buckets):
                self._table[i] = 0
            for s in range(self.slots):
                if self._key_hi[s] or self._key_lo[s]:
                    self._insert(s)
            self._stats.reset()
        self._hint.clear()
