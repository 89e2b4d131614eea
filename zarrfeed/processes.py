"""Facts about processes and hosts, from ``/proc``: whether a recorded process still runs.

A pid alone identifies nothing for long: pids are reused, and a host reboots.  A process is
named by its host and boot (:func:`host_identity`) and its pid, and judged alive only while
the pid belongs to a process that started no later than the one recorded.
"""

from __future__ import annotations

import os
import socket
from functools import cache

HOST_TAG = "zarrfeed/host"  # the Dagster run tag holding host_identity() of a run's host


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


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def process_alive(pid: int, since: float | None) -> bool:
    """Whether ``pid`` is a live (not zombie) process started no later than ``since``
    (epoch seconds; a later start means the pid was reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to judge
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    if fields[0] in ("Z", "X"):
        return False
    started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return since is None or started <= since + 1.0
