"""The build queue: partitions waiting for a run, released a bounded number at a time.

A first discovery of CT-RATE finds 50,000 scans, and a changed setting makes a nightly
evaluation find 50,000 stale partitions.  Returned as 50,000 run requests at once, a single
tick would create thousands of queued runs even batched (minutes of run-storage writes
inside one tick, a run queue and a UI that list them all).  Instead the sensor and the
schedule hand out at most :data:`PER_TICK` partitions, batched into runs, and only while
fewer than :data:`IN_FLIGHT` runs of the family are queued or running; the rest wait here,
in the store beside the catalog (``.zarrfeed/catalog/<family>/queue.json``: key → why), and
the discovery sensor releases them tick by tick.  Memory stays bounded by the keys, never by
run objects.

The sensor and the nightly schedule may write the queue at the same moment and one may lose
the other's additions; nothing is lost for good, since the next nightly evaluation finds
every missing or stale partition again.
"""

from __future__ import annotations

import dagster as dg

from zarrfeed.store import jsonio
from zarrfeed.store.backends import Backend
from zarrfeed.store.keys import check_asset
from zarrfeed.store.layout import catalog_path

PER_TICK = 4000  # partitions one tick may request (batched: a few hundred runs)
IN_FLIGHT = 2000  # queued + running runs of one family above which nothing more is released
ACTIVE = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


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
        self.release(None, added)

    def release(
        self, instance: dg.DagsterInstance | None, added: dict[str, str]
    ) -> list[tuple[str, str]]:
        """Add ``added`` (key → why) to the queue and take out what may run now: (key, why)
        pairs, at most :data:`PER_TICK`, none once :data:`IN_FLIGHT` runs are queued or
        running (none without an ``instance`` to count runs in)."""
        waiting = self.load()
        before = dict(waiting)
        waiting.update(added)
        room = 0
        if waiting and instance is not None:
            room = PER_TICK if self.in_flight(instance) < IN_FLIGHT else 0
        released = list(waiting.items())[: max(room, 0)]
        for key, _ in released:
            del waiting[key]
        if waiting != before:
            self.backend.write_atomic(self.path, jsonio.dumps(waiting))
        return released

    def in_flight(self, instance: dg.DagsterInstance) -> int:
        """Runs of this family's build job that are queued or running."""
        runs = dg.RunsFilter(statuses=ACTIVE, tags={"family": self.family})
        return instance.get_runs_count(runs)
