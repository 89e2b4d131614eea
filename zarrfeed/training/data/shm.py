"""Cache folders in RAM-backed shared memory, and the machine-wide rules that keep them few.

Every cache lives in its own folder ``zarrfeed-<kind>-<hash>`` under :func:`shm_root`, with a
``meta.json`` that says what it caches (store, assets, budget) and an ``owners`` file that
every process using the cache holds a shared ``flock`` on: the kernel drops it when the
process exits or dies, so "in use" never outlives a run.  Opening a cache first sweeps the
others (:func:`sweep`): unused ones idle longer than the age limit go, then unused ones
oldest first while the total would exceed the machine-wide cap — caches of other stores, old
commits and dead runs do not pile up in ``/dev/shm`` (Streaming's users met exactly that).
``zarrfeed cache list|clear`` shows and removes them by hand.

The folders are private to their account (:mod:`zarrfeed.cachedirs`): they live under
``<base>/zarrfeed-<uid>`` (mode ``0700``, files ``0600``), checked each time a cache is opened,
and a root or folder that another account made or linked is refused, never read.
``ZARRFEED_CACHE_GROUP`` shares them with a group instead (``<base>/zarrfeed-g<gid>``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zarrfeed import cachedirs
from zarrfeed.locks import flock_exclusive_now, flock_shared

log = logging.getLogger("zarrfeed.training")

PREFIX = "zarrfeed-"
OWNERS = "owners"
OPENING_S = 60.0  # a folder without its owners file this young is still being created


_ATTACH = threading.RLock()


def _new_attach_lock() -> None:
    global _ATTACH
    _ATTACH = threading.RLock()  # a child forked while another thread held it starts free


os.register_at_fork(after_in_child=_new_attach_lock)


def attach_lock() -> threading.RLock:
    """Serialises opening a cache in a process: two threads attaching at once would each
    replace the other's per-thread descriptors, and a lock taken through one and released
    through the other would never be released."""
    return _ATTACH


def shm_base() -> Path:
    """``ZARRFEED_CACHE_ROOT`` if set, else ``/dev/shm`` where it exists, else the temp folder:
    where the accounts' cache roots are."""
    if root := os.environ.get("ZARRFEED_CACHE_ROOT"):
        return Path(root)
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def shm_root(access: cachedirs.Access | None = None) -> Path:
    """The folder of this account's caches (or its group's), ``<base>/zarrfeed-<uid>``:
    a path only, made and checked by :func:`open_root`."""
    return shm_base() / (access or cachedirs.access()).root_name


def open_root(access: cachedirs.Access | None = None, create: bool = True) -> Path | None:
    """:func:`shm_root`, checked (and made when ``create``); None when absent and not made."""
    access = access or cachedirs.access()
    root = shm_root(access)
    if create:
        cachedirs.check_base(root.parent)
        return access.ensure(root)
    try:
        return access.check(root)
    except FileNotFoundError:
        return None


def memory_total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_cap() -> int:
    """Bytes all caches together may hold: ``ZARRFEED_CACHE_CAP_GB``, else half the RAM (a
    sweep sees only the caches of its account's root, or its group's)."""
    if gb := os.environ.get("ZARRFEED_CACHE_CAP_GB"):
        return int(float(gb) * (1 << 30))
    return memory_total() // 2


def max_idle_s() -> float:
    """How long an unused cache is kept: ``ZARRFEED_CACHE_MAX_AGE_H`` hours, else a day."""
    return float(os.environ.get("ZARRFEED_CACHE_MAX_AGE_H", "24")) * 3600


def reserve(fd: int, offset: int, nbytes: int, path: Path) -> None:
    """Allocate ``nbytes`` of a RAM-backed file now, failing with a clear message when the
    folder is full (Docker's 64 MB ``/dev/shm`` by default) instead of a SIGBUS later."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        usage = shutil.disk_usage(path.parent)
        raise OSError(
            exc.errno,
            f"cannot reserve {nbytes / 1e9:.2f} GB for {path} ({usage.free / 1e9:.2f} GB free "
            f"of {usage.total / 1e9:.2f} GB there): lower cache_gb, clear caches "
            "(zarrfeed cache clear --all), or give the container a larger /dev/shm",
        ) from exc


def held_bytes(folder: Path) -> int:
    """Bytes the kernel holds for the files of ``folder`` (allocated blocks, not sizes)."""
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(folder) as it:
        for entry in it:
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


@dataclass
class CacheInfo:
    """One cache folder as ``zarrfeed cache list`` shows it."""

    name: str
    kind: str
    store: str
    what: str
    bytes: int
    idle_s: float
    owners: list[int]


class CacheFolder:
    """A cache's folder, marked in use by this process for as long as it is open."""

    def __init__(self, kind: str, digest: str, meta: dict[str, Any]) -> None:
        self.kind, self.meta = kind, {"kind": kind, **meta}
        self.access = cachedirs.access()
        self.path = shm_root(self.access) / f"{PREFIX}{kind}-{digest}"
        self._owner_fd = -1

    def open(self, need_bytes: int) -> None:
        """Create the folder if needed, hold it, and sweep other caches to make room.  The
        account's root and the folder are checked first (owner, mode, no link): a folder
        another account made is refused with a ConfigError, never read."""
        access = self.access
        open_root(access)
        for _ in range(10):  # a sweep may remove the folder between mkdir and the lock
            access.ensure(self.path)
            meta = self.path / "meta.json"
            try:
                if not meta.exists():
                    tmp = meta.with_suffix(f".{os.getpid()}.tmp")
                    with open(tmp, "w", opener=access.open) as f:
                        f.write(json.dumps({**self.meta, "created": time.time()}))
                    os.replace(tmp, meta)
                fd = access.open(self.path / OWNERS, os.O_RDWR | os.O_CREAT)
            except FileNotFoundError:
                continue
            flock_shared(fd)
            now = _stat(self.path / OWNERS)
            if now is not None and os.path.samestat(os.fstat(fd), now):
                os.utime(fd)  # the last-used time
                self._owner_fd = fd
                break
            os.close(fd)  # swept away meanwhile: start again
        else:  # pragma: no cover - ten sweeps racing one open
            raise RuntimeError(f"could not open cache folder {self.path}")
        sweep(keep=self.path, need_bytes=need_bytes, root=self.path.parent)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_owner_fd": -1}  # a descriptor means nothing elsewhere

    def close(self) -> None:
        if self._owner_fd >= 0:
            os.close(self._owner_fd)
            self._owner_fd = -1

    def forget(self) -> None:
        """After fork: the inherited descriptor belongs to the parent's open (closed here;
        the child opens its own)."""
        if self._owner_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._owner_fd)
        self._owner_fd = -1


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _folders(root: Path | None) -> list[Path]:
    if root is None:  # no caches of this account yet
        return []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    return [
        Path(e.path)
        for e in entries
        if e.name.startswith(PREFIX)
        and e.is_dir(follow_symlinks=False)
        and os.path.exists(os.path.join(e.path, "meta.json"))
    ]


def _last_used(folder: Path) -> float:
    if (st := _stat(folder / OWNERS)) is not None:
        return st.st_mtime
    return (_stat(folder) or os.stat_result((0,) * 10)).st_mtime


def _remove(folder: Path) -> None:
    """Rename first (one atomic step: an opener then makes a fresh folder), then delete."""
    gone = folder.with_name(f".{folder.name}.removing-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.rename(folder, gone)
        shutil.rmtree(gone, ignore_errors=True)


def _remove_if_unused(folder: Path) -> bool:
    """Remove ``folder`` unless a process holds it; True when it is gone."""
    try:
        fd = os.open(folder / OWNERS, os.O_RDWR)
    except FileNotFoundError:  # being created right now, or left by a crash long ago
        if time.time() - _last_used(folder) < OPENING_S:
            return False
        _remove(folder)
        return True
    try:
        if not flock_exclusive_now(fd):
            return False
        _remove(folder)
        return True
    finally:
        os.close(fd)


def sweep(keep: Path | None = None, need_bytes: int = 0, root: Path | None = None) -> list[str]:
    """Remove unused caches idle past the age limit, then unused ones (oldest first) while
    all caches plus ``need_bytes`` exceed the machine-wide cap; names of those removed."""
    folders = [f for f in _folders(root or open_root(create=False)) if f != keep]
    now, cap, idle = time.time(), machine_cap(), max_idle_s()
    removed: list[str] = []
    for folder in sorted(folders, key=_last_used):
        if now - _last_used(folder) > idle and _remove_if_unused(folder):
            removed.append(folder.name)
    left = [f for f in folders if f.name not in removed]
    total = sum(held_bytes(f) for f in left) + (held_bytes(keep) if keep else 0)
    for folder in sorted(left, key=_last_used):
        if total + need_bytes <= cap:
            break
        size = held_bytes(folder)
        if _remove_if_unused(folder):
            removed.append(folder.name)
            total -= size
    if removed:
        log.info("zarrfeed caches removed (idle or over the machine cap): %s", ", ".join(removed))
    if total + need_bytes > cap:
        log.warning(
            "zarrfeed caches in use hold %.2f GB; with %.2f GB more they exceed the machine cap "
            "of %.2f GB (ZARRFEED_CACHE_CAP_GB)",
            total / 1e9,
            need_bytes / 1e9,
            cap / 1e9,
        )
    return removed


def _owners() -> dict[int, list[int]]:
    """inode → pids holding a FLOCK on it, from ``/proc/locks``."""
    found: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if len(parts) > 5 and parts[1] == "FLOCK" and parts[4].isdigit():
                inode = int(parts[5].rsplit(":", 1)[-1])
                found.setdefault(inode, []).append(int(parts[4]))
    return found


def list_caches(root: Path | None = None) -> list[CacheInfo]:
    """Every cache folder under the root, largest first."""
    owners, now, out = _owners(), time.time(), []
    for folder in _folders(root or open_root(create=False)):
        meta: dict[str, Any] = {"kind": "unreadable meta.json", "store": "?"}
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads((folder / "meta.json").read_text())
        st = _stat(folder / OWNERS)
        what = ", ".join(f"{a}:{'+'.join(n)}" for a, n in meta.get("arrays", {}).items())
        out.append(
            CacheInfo(
                name=folder.name,
                kind=meta["kind"],
                store=meta["store"],
                what=what,
                bytes=held_bytes(folder),
                idle_s=now - _last_used(folder),
                owners=sorted(owners.get(st.st_ino, [])) if st else [],
            )
        )
    return sorted(out, key=lambda c: -c.bytes)


def clear_caches(names: list[str] | None = None, root: Path | None = None) -> tuple[list, list]:
    """Remove the named caches (all when None) that no process holds: (removed, in use)."""
    removed, busy = [], []
    for folder in _folders(root or open_root(create=False)):
        if names is not None and folder.name not in names:
            continue
        (removed if _remove_if_unused(folder) else busy).append(folder.name)
    return removed, busy
