"""How many partitions one build run takes, how many of them build at once, and which run
requests cover a set of partitions.

A run costs a fixed start-up (process, instance, resources) whatever it builds, so a backfill
takes many partitions per run: enough rounds of the machine's cores that the start-up is a
small share of the run, few enough that a failed run's retry stays short.  Inside a run,
partitions build side by side, as many as there are cores — fewer when their working memory
would not fit in what the process may still allocate.  Pure arithmetic: the callers say what
the machine has (``zarrfeed.processes``) and what an item needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ROUNDS = 8  # rounds of the cores a run builds: its start-up is paid once per ROUNDS rounds
MIN_PER_RUN, MAX_PER_RUN = 16, 256  # a 1-core laptop still batches; a retry stays short
MEMORY_SHARE = 0.5  # of the allocatable memory a run's partitions in flight may hold
# Items needing this much working memory or more build in worker processes when several
# build at once: their builds take seconds, next to which a worker's start (~0.1 s from the
# fork server, ~2 s for the server's first) is small, and processes run side by side the
# parts that hold the interpreter lock, which threads take turns at.
PROCESS_ITEM_BYTES = 64 << 20


def per_run(cpus: int) -> int:
    """Partitions per backfill run on a machine with ``cpus`` usable cores."""
    return max(MIN_PER_RUN, min(MAX_PER_RUN, max(1, cpus) * ROUNDS))


def in_flight(cpus: int, memory: int, item_bytes: int, partitions: int) -> int:
    """Partitions one run builds at once: one per usable core, no more than ``memory``
    (bytes the process may still allocate) holds at :data:`MEMORY_SHARE` when each needs
    ``item_bytes`` of working memory, no more than the run's ``partitions``, at least one."""
    by_memory = int(memory * MEMORY_SHARE) // max(1, item_bytes)
    return max(1, min(cpus, by_memory, partitions))


def worker_processes(in_flight: int, item_bytes: int) -> bool:
    """Whether a run building ``in_flight`` items at once, each needing ``item_bytes`` of
    working memory, builds them in worker processes rather than threads."""
    return in_flight > 1 and item_bytes >= PROCESS_ITEM_BYTES


def ranges(order: Sequence[str], wanted: Iterable[str], size: int) -> list[list[str]]:
    """``wanted`` keys as runs of at most ``size`` keys, each run a stretch of consecutive
    keys of ``order`` (a partition range: a run builds every key between its first and
    last), in ``order``'s order.  Keys not in ``order`` are left out."""
    want = set(wanted)
    out: list[list[str]] = []
    current: list[str] = []
    for key in order:
        if key in want and len(current) < size:
            current.append(key)
            continue
        if current:
            out.append(current)
        current = [key] if key in want else []
    if current:
        out.append(current)
    return out
