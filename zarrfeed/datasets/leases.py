"""Leases: a live reader of a dataset version keeps it from garbage collection.

A reader (a Dataset, a training run, ``zarrfeed inspect``) writes one small object naming
the version it reads, ``.zarrfeed/leases/<lease>.json``, and a thread of its process writes
it again every :data:`RENEW_S` seconds: one small write per minute per reader.  Collection
keeps every version a live lease names.  A lease is live while its process runs, when the
collector runs on the same machine (and PID namespace) and can ask the kernel; otherwise
while it was renewed within :data:`TTL_S`.  So a reader killed with ``kill -9`` frees its
version at the next collection on its machine, and a lost machine's after ``TTL_S``.
A lease found gone at renewal (its store removed, or collected as dead after ``TTL_S``
without renewal) is not written back: that would make a removed store's folders again and
claim a version that collection may have taken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from zarrfeed.errors import ZarrfeedError
from zarrfeed.processlocal import ProcessLocal
from zarrfeed.store import jsonio
from zarrfeed.store.backends import Backend
from zarrfeed.store.layout import meta

log = logging.getLogger("zarrfeed")

RENEW_S = 60.0
TTL_S = 600.0  # a lease of another machine not renewed for this long is dead


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().strip()
    return None


def machine() -> str:
    """This machine and PID namespace: where a lease's PID can be asked about."""
    boot = _read("/proc/sys/kernel/random/boot_id") or ""
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = ""
    return f"{socket.gethostname()}|{boot}|{ns}"


def started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), telling a reused PID apart."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another account's process: it exists
    return start is None or started(pid) in (None, start)


class Lease:
    """A reader's hold on version ``snapshot`` of dataset ``dataset``, until :meth:`release`
    or its process ends."""

    def __init__(self, backend: Backend, dataset: str, snapshot: str) -> None:
        self.backend, self.dataset, self.snapshot = backend, dataset, snapshot
        self.pid = os.getpid()
        self.path = backend.join(meta("leases", f"{uuid.uuid4().hex}.json"))
        self._body = {
            "dataset": dataset,
            "snapshot": snapshot,
            "machine": machine(),
            "pid": self.pid,
            "started": started(self.pid),
            "host": socket.gethostname(),
        }
        self._write(parents=True)
        _RENEWER.add(self)

    def renew(self) -> bool:
        """Write the lease again, only where it still is; False once it is gone."""
        if not self.backend.exists(self.path):
            return False
        try:
            self._write(parents=False)
        except FileNotFoundError:  # its folder removed since
            return False
        return True

    def _write(self, parents: bool) -> None:
        body = {**self._body, "renewed_unix": time.time()}
        self.backend.write_atomic(self.path, jsonio.dumps(body), parents=parents)

    def release(self) -> None:
        """Give the version up (only the process that took the lease can: a forked
        worker's copy of it releases nothing)."""
        if os.getpid() != self.pid:
            return
        _RENEWER.discard(self)
        with contextlib.suppress(ZarrfeedError, OSError):
            self.backend.remove(self.path)


@dataclass
class _Renewing:
    """One process's leases and the thread renewing them."""

    leases: set[Lease] = field(default_factory=set)
    thread: threading.Thread | None = None


class _Renewer:
    """One daemon thread per process renewing its leases.  A forked child inherits the
    set but not the thread, and renews nothing: its parent's leases are the parent's."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mine = ProcessLocal(_Renewing)

    def add(self, lease: Lease) -> None:
        with self.lock:
            mine = self.mine.get()  # a forked child taking a lease of its own starts afresh
            mine.leases.add(lease)
            if mine.thread is None:
                mine.thread = threading.Thread(target=self._run, args=(mine,),
                                               name="zarrfeed-leases", daemon=True)  # fmt: skip
                mine.thread.start()

    def discard(self, lease: Lease) -> None:
        with self.lock:
            mine = self.mine.peek()
            if mine is not None:
                mine.leases.discard(lease)

    def _run(self, mine: _Renewing) -> None:
        while True:
            time.sleep(RENEW_S)
            with self.lock:
                leases = list(mine.leases)
            for lease in leases:
                with contextlib.suppress(ZarrfeedError, OSError):  # store unreachable: next round
                    if not lease.renew():
                        self.discard(lease)
                        log.warning(
                            "the lease on %s version %s (%s) was removed: its store is gone, "
                            "or it went unrenewed for %.0f s and was collected; the version "
                            "is no longer held from garbage collection",
                            lease.dataset, lease.snapshot, lease.path, TTL_S,
                        )  # fmt: skip


_RENEWER = _Renewer()
# A fork while the renewer held its lock would leave the child's copy locked forever.
os.register_at_fork(after_in_child=lambda: setattr(_RENEWER, "lock", threading.Lock()))


def live(backend: Backend, now: float | None = None) -> list[dict[str, Any]]:
    """Every live lease of the store (dead ones are removed on the way)."""
    now = time.time() if now is None else now
    folder, here = backend.join(meta("leases")), machine()
    names = [n for n in backend.list_dir(folder) if n.endswith(".json")]
    found = backend.read_many([f"{folder}/{n}" for n in names])
    out = []
    for name, data in zip(names, found, strict=True):
        if data is None:
            continue  # released meanwhile
        try:
            lease = jsonio.loads(data)
            pid, renewed = int(lease["pid"]), float(lease["renewed_unix"])
        except (ValueError, KeyError, TypeError):
            continue  # another writer's temporary, or damaged: a damaged lease holds nothing
        if lease.get("machine") == here:
            ok = alive(pid, lease.get("started"))
        else:
            ok = now - renewed < TTL_S
        if ok:
            out.append(lease)
        else:
            with contextlib.suppress(ZarrfeedError, OSError):
                backend.remove(f"{folder}/{name}")
    return out
