"""The crash that used to block the queue forever, and the recovery the instance must make.

As many runs as the queue has slots are launched and caught mid-step in raw ingest, hashing
a raw file that is 8 GiB of zeros (sparse: no disk).  Then the machine running the code
server, its run processes and the workers is lost: all of them are killed with SIGKILL, so
nothing is left to notice that the runs died.  The supervisor restarts the code server and
the workers.

Run monitoring must fail the runs within their bound (the ``dagster/max_runtime`` tag plus
the poll interval), which frees the queue (the nightly store maintenance, submitted while
the queue is full, starts) and their pool slots; the automatic retry must then complete
their partitions.

The bound follows this machine as it is now: before the crash one partition is built in the
same deployment, and the bound is :data:`RUNTIME_MULTIPLE` times that run's launch and run
(no less than :data:`MIN_RUNTIME_S`).  A fixed 40 s failed at load 6-7, where a retry that
takes 12.9 s on an idle machine ran past it.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
from services import Deployment

HOLD_BYTES = 8 * 2**30
# The crashed runs' dagster/max_runtime (their retries inherit it) must be longer than the
# restart of a code server (a retry attempted while the daemon cannot reach the code location
# is not attempted again) and than a retry itself, on the machine as loaded as it is, as in
# production, where it is hours: a multiple of one measured build of a partition, launch
# (a run process loading the code location, as a code server does) included.
RUNTIME_MULTIPLE = 3
MIN_RUNTIME_S = 40
LATER_JOB = "store_maintenance"  # one cheap step: what matters is when it starts
POLL_S = 2  # run_monitoring.poll_interval_seconds in the tests' instances
SLACK_S = 15  # daemon iteration, event writes, a loaded machine


def hold(paths: list[Path], aside: Path) -> Callable[[], None]:
    """Replace each raw file by a sparse file of zeros; returns what puts the files back."""
    aside.mkdir(parents=True, exist_ok=True)
    for path in paths:
        shutil.move(path, aside / path.name)
        with open(path, "wb") as f:
            f.truncate(HOLD_BYTES)

    def restore() -> None:
        for path in paths:
            path.unlink()
            shutil.move(aside / path.name, path)

    return restore


def step_events(instance: Any, run_id: str, kind: Any) -> list[Any]:
    return instance.get_records_for_run(run_id, of_type=kind).records


def run_record(instance: Any, run_id: str) -> Any:
    return instance.get_run_record_by_id(run_id)


def failures(instance: Any, run: Any) -> list[str]:
    """Why ``run`` failed: the messages of its step and run failure events."""
    kinds = (dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE)
    records = [r for kind in kinds for r in step_events(instance, run.run_id, kind)]
    return [r.event_log_entry.message or "" for r in records] or [str(run.status)]


def measured_runtime(d: Deployment, instance: Any, key: str, run_config: dict) -> float:
    """Seconds one ``ct_build`` run of partition ``key`` takes in ``d`` now, from its launch
    (its process starts and loads the code location) to its end."""
    launched = time.time()
    run_id = d.launch_run("ct_build", key, run_config)
    record = d.wait_until(
        lambda: (r := run_record(instance, run_id)).dagster_run.is_finished and r,
        600,
        f"the build of partition {key} that measures this machine",
    )
    assert record.dagster_run.is_success, failures(instance, record.dagster_run)
    return record.end_time - launched


def crash_and_recover(
    d: Deployment,
    victims: dict[str, Path],
    run_config: dict,
    measure: str,
    workers: tuple[str, ...] = (),
) -> dict[str, float]:
    """The whole scenario on ``d``; ``victims`` maps partition keys to their raw files (one
    per run slot); partition ``measure``, not built yet and not a victim, is built first to
    size the runs' bound.  Returns the measured seconds."""
    assert measure not in victims
    with d.instance() as instance:
        one_run = measured_runtime(d, instance, measure, run_config)
    bound = max(MIN_RUNTIME_S, math.ceil(RUNTIME_MULTIPLE * one_run))
    restore = hold(list(victims.values()), d.home.parent / "held")
    tags = {"dagster/max_runtime": str(bound)}
    ids = [d.launch_run("ct_build", key, run_config, tags) for key in victims]
    with d.instance() as instance:

        def mid_step() -> bool:
            """Every run started and a step of one running (a Celery worker may hold the next
            run's task until its step ends: prefetch with early acknowledgement)."""
            started = all(
                run_record(instance, i).dagster_run.status == dg.DagsterRunStatus.STARTED
                for i in ids
            )
            return started and any(
                step_events(instance, i, dg.DagsterEventType.STEP_START) for i in ids
            )

        d.wait_until(mid_step, 180, "the runs to start and one of their steps to run")
        old_server = d.code_server_id()
        killed_at = time.time()
        for name in ("code_server", *workers):  # the lost machine: runs, steps, workers
            d.kill(name)
        d.start_code_server()  # the supervisor brings the machine's services back
        for name in workers:
            d.start_worker(name)
        ends = (dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE)
        ended = [e for i in ids for kind in ends for e in step_events(instance, i, kind)]
        assert not ended, "a step ended before the kill: the crash did not happen mid-step"
        restore()
        d.wait_new_code_server(old_server)
        d.wait_ready(list(workers))
        later_id = d.launch_run(LATER_JOB)

        def failed() -> list[Any] | None:
            records = [run_record(instance, i) for i in ids]
            return records if all(r.dagster_run.is_finished for r in records) else None

        records = d.wait_until(failed, bound + 120, "run monitoring to end the crashed runs")
        for r in records:
            assert r.dagster_run.status == dg.DagsterRunStatus.FAILURE, r.dagster_run.status
            lasted = r.end_time - r.start_time
            assert lasted <= bound + 2 * POLL_S + SLACK_S, (
                f"run {r.dagster_run.run_id} failed {lasted:.0f}s after it started: beyond "
                f"its {bound}s bound ({RUNTIME_MULTIPLE} x {one_run:.1f}s, one build here)"
            )
        first_failure = min(r.end_time for r in records)

        later_record = d.wait_until(
            lambda: (r := run_record(instance, later_id)).dagster_run.is_finished and r,
            300,
            "the run launched after the crash",
        )
        assert later_record.dagster_run.is_success
        assert later_record.start_time >= first_failure, "it started while the queue was full"

        def retried() -> list[Any] | None:
            runs = [
                instance.get_runs(filters=dg.RunsFilter(tags={"dagster/parent_run_id": i}))
                for i in ids
            ]
            done = all(len(r) == 1 and r[0].is_finished for r in runs)
            return [r[0] for r in runs] if done else None

        retries = d.wait_until(retried, bound + 300, "the automatic retries of the crashed runs")
        for retry in retries:
            assert retry.is_success, (retry.tags["dagster/partition"], failures(instance, retry))
            assert instance.get_run_stats(retry.run_id).steps_failed == 0
            made = step_events(instance, retry.run_id, dg.DagsterEventType.ASSET_MATERIALIZATION)
            assert made, "the retry materialised nothing"
            for event in made:  # a retry from the failed step built what the crash left
                key = event.event_log_entry.dagster_event.asset_key
                assert retry.tags["dagster/partition"] in instance.get_materialized_partitions(key)
    return {
        "one_build_s": one_run,
        "max_runtime_s": bound,
        "failed_after_start_s": max(r.end_time - r.start_time for r in records),
        "failed_after_kill_s": max(r.end_time for r in records) - killed_at,
    }
