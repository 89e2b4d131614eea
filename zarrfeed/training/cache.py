"""A byte-budgeted LRU cache of decoded arrays, one copy per machine for every process.

Entries are ``.npy`` files in a RAM-backed folder (``/dev/shm``) that every process maps
read-only, so DataLoader workers — forked, forkserver'd or spawned, and DDP ranks on the same
machine — share one copy instead of one each (MONAI's cache is copied per worker and per rank;
``shared/notes/loaders.md`` §6).  The OS page cache is the storage; the cache adds the byte
budget, least-recently-used eviction and statistics:

* a hit maps the file once per process and touches its mtime (the LRU clock): one syscall;
* a miss evicts the oldest entries to make room (holding an ``flock`` on the folder), decodes
  the array under a temporary name and renames it into place; a :class:`Fill` decodes straight
  into the mapped file (no second copy, pages mapped up front);
  a concurrent miss of the same key waits for the first writer instead of decoding twice;
* an evicted entry that a process still maps stays valid for that process (POSIX unlink).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STAT_ROWS = 512  # processes that can report statistics at once (rows are reclaimed by pid)
HITS, MISSES, BYTES_READ, EVICTIONS = range(4)


def shm_root() -> Path:
    """``ZARRFEED_CACHE_ROOT`` if set, else ``/dev/shm`` where it exists, else the temp folder.

    Entries outlive the processes on purpose (the next run starts warm); ``clear()`` or
    removing the folder frees the memory.
    """
    if root := os.environ.get("ZARRFEED_CACHE_ROOT"):
        return Path(root)
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


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
    """Arrays by key, shared through a RAM-backed folder, within ``budget_bytes``."""

    def __init__(self, name: str, budget_bytes: int, root: str | Path | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        safe = hashlib.sha256(name.encode()).hexdigest()[:16]
        self.name, self.budget_bytes = name, int(budget_bytes)
        self.folder = Path(root or shm_root()) / f"zarrfeed-cache-{safe}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._reset_local()

    # pickling and fork: only the name and budget travel; handles are per process ---------
    def __getstate__(self) -> dict:
        return {"name": self.name, "budget_bytes": self.budget_bytes, "folder": self.folder}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_local()

    def _reset_local(self) -> None:
        self._pid = os.getpid()
        self._mapped: dict[str, np.ndarray] = {}
        self._stats: np.memmap | None = None
        self._row = -1

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: mappings are inherited but the stats row is not
            self._reset_local()

    # statistics ------------------------------------------------------------------------------
    def _stat_table(self) -> np.memmap:
        if self._stats is None:
            path = self.folder / ".stats"
            with self._locked():
                if not path.exists():
                    np.zeros((STAT_ROWS, 5), dtype=np.int64).tofile(path)
                table = np.memmap(path, dtype=np.int64, mode="r+", shape=(STAT_ROWS, 5))
                pid = os.getpid()
                mine = np.flatnonzero(table[:, 0] == pid)
                if mine.size:
                    self._row = int(mine[0])
                else:  # a free row, or one of a dead process (its counts still count)
                    rows = (r for r in range(STAT_ROWS) if not _alive(int(table[r, 0])))
                    self._row = next(rows, STAT_ROWS - 1)
                    table[self._row, 0] = pid
            self._stats = table
        return self._stats

    def _count(self, column: int, n: int = 1) -> None:
        self._stat_table()[self._row, 1 + column] += n

    def stats(self) -> dict[str, int | float]:
        """Hits, misses, bytes decoded, evictions (all processes), entries and bytes held."""
        totals = self._stat_table()[:, 1:].sum(axis=0)
        entries = list(self._entries())
        held = sum(size for _, size, _ in entries)
        lookups = int(totals[HITS] + totals[MISSES])
        return {
            "hits": int(totals[HITS]),
            "misses": int(totals[MISSES]),
            "hit_rate": float(totals[HITS] / lookups) if lookups else 0.0,
            "bytes_decoded": int(totals[BYTES_READ]),
            "evictions": int(totals[EVICTIONS]),
            "entries": len(entries),
            "bytes_held": held,
            "budget_bytes": self.budget_bytes,
        }

    # the cache ---------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.npy"

    def get(
        self,
        key: str,
        load: Callable[[], np.ndarray] | Fill,
        wait_s: float = 600.0,
        wait: bool = True,
    ) -> np.ndarray | None:
        """The cached array for ``key`` (read-only), decoding it with ``load`` on a miss.

        With ``wait=False``, a key that another process is decoding right now returns None
        at once, so the caller can read just the piece it needs meanwhile.
        """
        self._check_pid()
        path = self._path(key)
        arr = self._mapped.get(key)
        try:
            os.utime(path)  # LRU clock; raises if the entry was evicted
            if arr is None:
                arr = self._mapped[key] = _map_npy(path)
            self._count(HITS)
            return arr
        except FileNotFoundError:
            self._mapped.pop(key, None)
        return self._miss(key, path, load, wait_s, wait)

    def _miss(
        self, key: str, path: Path, load: Callable[[], np.ndarray] | Fill, wait_s: float, wait: bool
    ) -> np.ndarray | None:
        filling = path.with_suffix(".filling")
        try:
            fd = os.open(filling, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # another process is decoding this key
            if not wait:
                self._count(MISSES)
                return None
            deadline = time.monotonic() + wait_s
            while filling.exists() and time.monotonic() < deadline and not path.exists():
                time.sleep(0.005)
            if path.exists():
                return self.get(key, load, wait_s)
            with contextlib.suppress(FileNotFoundError):
                if time.monotonic() >= deadline:
                    filling.unlink()  # the writer died
            return self.get(key, load, wait_s)
        os.close(fd)
        try:
            if isinstance(load, Fill):
                return self._fill(key, path, load)
            data = np.ascontiguousarray(load())
            self._count(MISSES)
            self._count(BYTES_READ, data.nbytes)
            if data.nbytes > self.budget_bytes:
                return data  # larger than the whole budget: serve it uncached
            tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
            with self._locked():
                self._evict(self.budget_bytes - data.nbytes)
                with open(tmp, "wb") as f:  # np.save would append ".npy" to a bare path
                    np.save(f, data)
                os.replace(tmp, path)
            arr = self._mapped[key] = _map_npy(path)
            return arr
        finally:
            with contextlib.suppress(FileNotFoundError):
                filling.unlink()

    def _fill(self, key: str, path: Path, fill: Fill) -> np.ndarray:
        self._count(MISSES)
        self._count(BYTES_READ, fill.nbytes)
        if fill.nbytes > self.budget_bytes:
            out = np.empty(fill.shape, fill.dtype)
            fill.into(out)
            return out  # larger than the whole budget: serve it uncached
        tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
        with self._locked():
            self._evict(self.budget_bytes - fill.nbytes)
            with open(tmp, "wb") as f:  # the .npy header, then the data's size (sparse)
                header = {
                    "descr": np.lib.format.dtype_to_descr(np.dtype(fill.dtype)),
                    "fortran_order": False,
                    "shape": tuple(fill.shape),
                }
                np.lib.format.write_array_header_1_0(f, header)
                f.truncate(f.tell() + fill.nbytes)
        try:
            arr = _map_npy(tmp, writable=True)
            fill.into(arr)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        arr.flags.writeable = False  # this mapping stays: its pages are already mapped
        self._mapped[key] = arr
        return arr

    def _entries(self) -> Iterator[tuple[Path, int, float]]:
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".npy"):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    yield Path(entry.path), st.st_size, st.st_mtime

    def _evict(self, keep_bytes: int) -> None:
        """Remove least-recently-used entries until at most ``keep_bytes`` remain (locked)."""
        entries = sorted(self._entries(), key=lambda e: e[2])
        held = sum(size for _, size, _ in entries)
        for path, size, _ in entries:
            if held <= keep_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                held -= size
                self._count(EVICTIONS)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.folder / ".lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def clear(self) -> None:
        """Drop every entry and the statistics (other processes' mappings stay valid)."""
        with self._locked():
            for path in self.folder.iterdir():
                if path.name != ".lock":
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
        self._reset_local()


def _map_npy(path: Path, writable: bool = False) -> np.ndarray:
    """A ``.npy`` file mapped whole with its pages mapped up front (``MAP_POPULATE``): one
    call instead of a page fault per 4 KiB on first touch (~2 µs each, 50 ms per 110 MB)."""
    with open(path, "r+b" if writable else "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }[version]
        shape, fortran, dtype = read_header(f)
        offset = f.tell()
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(f.fileno(), 0, flags=flags, prot=prot)
    return np.ndarray(shape, dtype, buffer=mapped, offset=offset, order="F" if fortran else "C")


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0: a row never used
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
