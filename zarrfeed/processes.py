"""Facts about this process and its host: the CPUs and memory it may use, whether a recorded
process still runs, and which host and boot a pid belongs to.

A pid alone identifies nothing for long: pids are reused, and a host reboots.  A process is
named by its host and boot (:func:`host_identity`) and its pid, and judged alive only while
the pid belongs to a live process that started no later than the one recorded.  CPUs and
memory are what this process may get — its affinity and cgroup quota, the memory its cgroup
and address-space limit leave — not the host's totals.  :func:`hold` keeps a folder to one
process at a time, by a lock the kernel releases when its holder dies.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import socket
import time
from functools import cache
from pathlib import Path

import psutil

from zarrfeed import locks
from zarrfeed.errors import ZarrfeedError

HOST_TAG = "zarrfeed/host"  # the Dagster run tag holding host_identity() of a run's host


def cpu_budget() -> tuple[int, str]:
    """CPUs this process may use: affinity, capped by a cgroup v2 CPU quota; and how."""
    affinity = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            limit = max(1, math.floor(int(quota) / int(period)))
            if limit < affinity:
                return limit, f"cgroup quota {quota}/{period} (affinity {affinity})"
    except (OSError, ValueError):
        pass
    return affinity, f"sched_getaffinity ({os.cpu_count()} on the host)"


def usable_cpus() -> int:
    """CPUs this process may use (:func:`cpu_budget`), not the host's count."""
    return cpu_budget()[0]


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_memory() -> int:
    """Bytes this process can still allocate: the least of the machine's available memory,
    what its cgroup (a container's memory limit) leaves, and what its address-space limit
    (``ulimit -v``) leaves."""
    bounds = [psutil.virtual_memory().available]
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        bounds.append(max(limit - used, 0))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        bounds.append(max(soft - psutil.Process().memory_info().vms, 0))
    return min(bounds)


@cache
def host_identity() -> str:
    """``hostname/boot id/pid namespace``, where pids mean something: the boot id changes at
    every boot, so a pid recorded before a reboot is never taken for a process after it, and
    containers on one kernel share the boot id but not the pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, namespace = "unknown-boot", 0
    return f"{socket.gethostname()}/{boot}/{namespace}"


def rebooted(identity: str) -> bool:
    """Whether ``identity`` (a :func:`host_identity`) names this host before its last boot."""
    host, boot, *_ = (*identity.split("/"), "", "")
    here_host, here_boot, *_ = host_identity().split("/")
    return host == here_host and boot != here_boot


def process_alive(pid: int, since: float | None = None) -> bool:
    """Whether ``pid`` is a live (not zombie) process, started no later than ``since``
    (epoch seconds; a later start means the pid was reused).  Pids 0 and below are no
    process (a table row never used)."""
    if pid <= 0:
        return False
    try:
        process = psutil.Process(pid)
        status, started = process.status(), process.create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # not ours to judge
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return False
    return since is None or started <= since + 1.0


class Held(ZarrfeedError):
    """What :func:`hold` found holding a lock: its holder's pid, host and start (as the lock
    file records them; None while the holder has not written them yet)."""

    def __init__(self, path: Path, holder: dict) -> None:
        self.path, self.holder = path, holder
        self.pid, self.host = holder.get("pid"), holder.get("host")
        super().__init__(f"{path} is held by {self.who()}")

    def who(self) -> str:
        if self.pid is None:
            return "a process that is starting (it has not written its pid yet)"
        since = self.holder.get("since")
        when = (
            f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if since else ""
        )
        what = self.holder.get("what")
        return f"{what + ', ' if what else ''}pid {self.pid} on {self.host}{when}"


class Hold:
    """An exclusive ``flock`` on a lock file, held by this process until :meth:`release` or
    its death (the kernel drops it with the last descriptor: ``kill -9`` leaves no stale
    lock).  The file records the holder (pid, host, start), for whoever is refused.  A child
    forked while it is held shares it, as it shares the descriptor."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the only descriptor releases the lock

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold(path: str | os.PathLike, what: str = "") -> Hold:
    """Take the lock file ``path`` (created with its folder) for this process, or raise
    :class:`Held` naming its holder (``what`` it is, its pid and host) at once, without
    waiting."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        taken = locks.flock_exclusive_now(fd)
    except BaseException:
        os.close(fd)
        raise
    if not taken:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:  # written half (a holder between truncate and write)
            holder = {}
        os.close(fd)
        raise Held(path, holder if isinstance(holder, dict) else {})
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": what}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return Hold(path, fd)
