"""Runs whose process is gone are failed, however they were launched.

Dagster's run monitoring watches the runs its daemon's run launcher started.  A run started
by ``dg launch``, ``dagster asset materialize`` or ``execute_in_process`` has no launcher to
ask, nor has a ``zarrfeed demo`` run once the demo's webserver and code server are gone with
it: killed, it stays STARTED, holds a run slot (``max_concurrent_runs``) and its pool slots,
and a queued run waits until the maximum runtime.

Every zarrfeed run says where it runs: the store resource, which every step uses, tags the
run when a step starts with its host, boot and pid namespace
(:func:`zarrfeed.processes.host_identity`) and with the pid of the process that orchestrates
the run (:func:`orchestrating_pid`).  The ``dead_runs`` sensor, on the daemon's host, fails
every started run of that host whose orchestrating process no longer exists — or is a newer
process that reuses its pid, or the host has rebooted since — with a message saying so,
which ``zarrfeed status`` shows as the cause.
Runs on other hosts are left to a daemon there; runs without a recorded process (a Celery
run, a run whose first step has not started) to Dagster's own monitoring.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import dagster as dg

from zarrfeed.processes import HOST_TAG, host_identity, process_alive, rebooted

IN_PROGRESS = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]
PID_TAG = "zarrfeed/pid"  # the run tag holding the pid of the process orchestrating the run
IN_PROCESS = "in_process"  # the deployment executor's setting: every step in the run's process


def runs_in_process(run: dg.DagsterRun | None) -> bool:
    """Whether ``run`` asked the deployment's executor to run its steps in its own process
    (``execution: {config: {in_process: true}}``, as ``zarrfeed demo``'s runs do)."""
    execution = (run.run_config.get("execution") or {}) if run is not None else {}
    return bool((execution.get("config") or {}).get(IN_PROCESS))


def orchestrating_pid(in_process: bool = False) -> int | None:
    """The pid of the process that orchestrates the run of the step executing here: this
    process under an in-process executor (``execute_in_process``, ``dg.materialize``, ``dg
    launch``; ``in_process``: a run that asked for it, whose process a code server started),
    its parent when Dagster's multiprocess executor started it (through Python's
    ``multiprocessing``, whatever the start method), and none in a Celery worker, whose
    run's process lives elsewhere."""
    celery = sys.modules.get("celery")
    if celery is not None and celery.current_task:
        return None
    parent = None if in_process else multiprocessing.parent_process()
    return parent.pid if parent is not None else os.getpid()


def orchestrator_pid(run: dg.DagsterRun) -> int | None:
    """The pid of the process that orchestrates ``run``, as its steps tagged it."""
    pid = run.tags.get(PID_TAG)
    return int(pid) if pid is not None else None


def fail_dead_runs(instance: dg.DagsterInstance) -> list[tuple[str, str]]:
    """Fail every started run of this host whose orchestrating process is gone; the
    (run id, message) of each, the message as the run's failure says it."""
    failed = []
    here = host_identity()
    for record in instance.get_run_records(dg.RunsFilter(statuses=IN_PROGRESS)):
        run = record.dagster_run
        host = run.tags.get(HOST_TAG, "")
        if host != here and not rebooted(host):
            continue  # another host or container: its own dead_runs sensor judges
        if (pid := orchestrator_pid(run)) is None:
            continue
        if host == here and process_alive(pid, record.start_time):
            continue
        gone = "it was killed or crashed" if host == here else "the host rebooted since"
        message = (
            f"the process running it (pid {pid} on {host.split('/')[0]}) is gone: {gone}; marked "
            "failed so that it no longer holds a run slot — launch the partition again"
        )
        instance.report_run_failed(run, message=message)
        failed.append((run.run_id, message))
    return failed


@dg.sensor(
    name="dead_runs",
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Fails runs of this host whose process is gone (killed `dg launch`, demo or "
    "in-process runs that Dagster's run monitoring does not watch), freeing their slots.",
    tags={"stage": "maintenance"},
)
def dead_runs(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    t0 = time.monotonic()
    failed = fail_dead_runs(context.instance)
    for run_id, message in failed:
        context.log.warning(f"run {run_id}: {message}")
    return dg.SkipReason(
        f"failed {len(failed)} runs whose process was gone ({time.monotonic() - t0:.2f} s)"
        if failed
        else "every started run of this host has a live process"
    )
