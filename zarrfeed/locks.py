"""File locks that the kernel releases when their holder dies: the three kinds zarrfeed uses,
each for what only it does (a process killed with SIGKILL drops all three at once, so nothing
ever waits on a dead holder).

* **Byte ranges of one open** (open-file-description locks, ``F_OFD_SETLK``): owned by one
  ``open()`` of a file, so two threads or a parent and its forked child exclude each other as
  long as each opened the file itself.  Any byte offset can be locked, beyond the end of the
  file too, so one file holds a lock per cache slot or entry.
* **Whole files** (``flock``): shared by every descriptor of one open, a forked child's copy
  included — a cache folder in use, a process's hold on a lock file.
* **Whole files owned by the process** (``lockf``, a POSIX record lock): a child forked while
  a thread held it does not inherit it, so a short critical section taken by many threads
  (each opening the file anew) can never be left held by a child that knows nothing of it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from collections.abc import Callable

if not hasattr(fcntl, "F_OFD_SETLK"):  # pragma: no cover - Linux has had them since 3.15
    raise ImportError("zarrfeed's shared cache needs Linux open-file-description locks")

# struct flock on Linux: l_type, l_whence (short), l_start, l_len (off_t), l_pid, padding.
_FLOCK = struct.Struct("hhqqi4x")


def _request(fd: int, command: int, kind: int, start: int, length: int) -> bytes:
    return fcntl.fcntl(fd, command, _FLOCK.pack(kind, 0, start, length, 0))


def lock(fd: int, start: int, exclusive: bool = True, wait: bool = True, length: int = 1) -> bool:
    """Lock ``length`` bytes at ``start``; False when ``wait`` is off and another holds them."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        _request(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, kind, start, length)
    except OSError as exc:
        if not wait and exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, start: int, length: int = 1) -> None:
    _request(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, start, length)


def held_by_other(fd: int, start: int, length: int = 1) -> bool:
    """Whether another open file description holds a lock on those bytes now."""
    found = _request(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, start, length)
    return _FLOCK.unpack(found)[0] != fcntl.F_UNLCK


def flock_shared(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_SH)


def flock_exclusive_now(fd: int) -> bool:
    """Take the whole-file lock exclusively if nobody holds it (shared or not)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_for_process(fd: int) -> None:
    """Wait for the whole file's process-owned lock (released when ``fd`` is closed)."""
    fcntl.lockf(fd, fcntl.LOCK_EX)


def open_for_thread(
    path: str | os.PathLike,
    flags: int,
    fds: dict[int, threading.Thread],
    opener: Callable[[str | os.PathLike, int], int],
) -> int:
    """A new open of ``path`` for the calling thread through ``opener`` (the cache's
    :meth:`~zarrfeed.cachedirs.Access.open`: its file mode, no links), recorded in ``fds``
    (descriptor → its thread); the descriptors of threads that have ended are closed first.
    An ended thread holds no lock through its open any more, and one descriptor per
    short-lived thread (a prefetch thread per epoch) would otherwise stay open for the life
    of the process.  Callers serialise calls on one ``fds``."""
    for fd, thread in list(fds.items()):
        if not thread.is_alive():
            del fds[fd]
            os.close(fd)
    fd = opener(path, flags)
    fds[fd] = threading.current_thread()
    return fd
