"""Facts about this process and its host: the CPUs and memory it may use, whether a recorded
process still runs, and which host and boot a pid belongs to.

A pid alone identifies nothing for long: pids are reused, and a host reboots.  A process is
named by its host and boot (:func:`host_identity`) and its pid, and judged alive only while
the pid belongs to a live process that started no later than the one recorded.  CPUs and
memory are what this process may get — its affinity and cgroup quota, the memory its cgroup
and address-space limit leave — not the host's totals.
"""

from __future__ import annotations

import math
import os
import resource
import socket
from functools import cache
from pathlib import Path

import psutil

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
