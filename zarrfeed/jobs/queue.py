"""The build queue: partitions waiting for a run, released a bounded number at a time.

A first discovery of CT-RATE finds 50,000 scans, and a changed setting makes a nightly
evaluation find 50,000 stale partitions.  Returned as 50,000 run requests at once, a single
tick would create thousands of queued runs even batched (minutes of run-storage writes
inside one tick, a run queue and a UI that list them all).  Instead the sensor and the
schedule request at most :data:`PER_TICK` runs a tick (each a batch of consecutive
partitions), never more than leave :data:`IN_FLIGHT` runs of the family queued or running;
the rest wait here, in the store beside the catalog
(``.zarrfeed/catalog/<family>/queue.json``: key → why), and the discovery sensor releases
them tick by tick.  Memory stays bounded by the keys, never by run objects.

The sensor and the nightly schedule may write the queue at the same moment and one may lose
the other's additions; nothing is lost for good, since the next nightly evaluation finds
every missing or stale partition again.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import dagster as dg

from zarrfeed.assets.build import BATCH
from zarrfeed.batching import ranges
from zarrfeed.store import jsonio
from zarrfeed.store.backends import Backend
from zarrfeed.store.keys import check_asset
from zarrfeed.store.layout import catalog_path

PER_TICK = 200  # runs one tick may request (each a batch of up to BATCH's partitions)
IN_FLIGHT = 2000  # queued + running runs of one family: never more are requested
ACTIVE = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def room(in_flight: int) -> int:
    """Runs a tick may request while ``in_flight`` runs of the family are queued or
    running."""
    return max(0, min(PER_TICK, IN_FLIGHT - in_flight))


class BuildQueue:
    """The waiting partitions of one family, oldest first."""

    def __init__(self, backend: Backend, family: str) -> None:
        self.backend, self.family = backend, check_asset(family)
        self.path = backend.join(catalog_path(family), "queue.json")

    def load(self) -> dict[str, str]:
        try:
            return jsonio.loads(self.backend.read(self.path))
        except FileNotFoundError:
            return {}

    def add(self, added: dict[str, str]) -> None:
        """Queue ``added`` (key → why) behind what already waits."""
        self.backend.write_atomic(self.path, jsonio.dumps({**self.load(), **added}))

    def release(
        self,
        instance: dg.DagsterInstance | None,
        added: dict[str, str],
        segments: Sequence[Sequence[str]] = (),
        sources: Container[str] = (),
    ) -> list[list[tuple[str, str]]]:
        """Add ``added`` (key → why) to the queue and take out the runs that may start now:
        each a stretch of at most a backfill batch of consecutive waiting keys of one of
        ``segments`` (partition keys in the order Dagster resolves a range in; a run never
        spans two segments), :func:`room` runs at most (none without an ``instance`` to
        count runs in).  Keys without a raw source (not in ``sources``) leave the queue;
        keys in no segment wait for a later tick."""
        waiting = self.load()
        before = dict(waiting)
        waiting.update(added)
        for key in [k for k in waiting if k not in sources]:
            del waiting[key]
        runs: list[list[str]] = []
        if waiting and instance is not None:
            size = BATCH.max_partitions_per_run or 1
            allowed = room(self.in_flight(instance))
            for segment in segments:
                runs += ranges(segment, waiting, size)[: allowed - len(runs)]
        released = [[(key, waiting.pop(key)) for key in run] for run in runs]
        if waiting != before:
            self.backend.write_atomic(self.path, jsonio.dumps(waiting))
        return released

    def in_flight(self, instance: dg.DagsterInstance) -> int:
        """Runs of this family's build job that are queued or running."""
        runs = dg.RunsFilter(statuses=ACTIVE, tags={"family": self.family})
        return instance.get_runs_count(runs)
