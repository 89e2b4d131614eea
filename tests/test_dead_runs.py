"""Runs killed outside the daemon's run launcher (``dg launch``; the demo's, its webserver and
code server killed with them) are failed by the ``dead_runs`` sensor once their process is
gone, so they free their run slot, and ``zarrfeed status`` says what happened: on a SQLite and
a Postgres instance."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from crash import hold
from ct_builds import ct_raw, register
from services import postgres_database, wait_for

from zarrfeed.commands.status import partition_states
from zarrfeed.families.ct import CT
from zarrfeed.jobs.liveness import (
    IN_PROGRESS,
    dead_runs,
    orchestrating_pid,
    orchestrator_pid,
    runs_in_process,
)
from zarrfeed.processes import HOST_TAG, host_identity

pytestmark = pytest.mark.slow

SQLITE = """\
telemetry: {enabled: false}
run_coordinator: {module: dagster.core.run_coordinator, class: QueuedRunCoordinator}
concurrency: {runs: {max_concurrent_runs: 1}}
"""
POSTGRES = (
    SQLITE
    + """\
storage:
  postgres:
    postgres_db:
      scheme: postgresql+psycopg2
      hostname: {env: DAGSTER_PG_HOST}
      port: {env: DAGSTER_PG_PORT}
      username: {env: DAGSTER_PG_USERNAME}
      password: {env: DAGSTER_PG_PASSWORD}
      db_name: {env: DAGSTER_PG_DB}
"""
)
# Runs the demo's way (``zarrfeed.commands.demo.run``: through its webserver) in a fresh
# interpreter.
DEMO_RUN = """
import os, sys, dagster as dg
from pathlib import Path
from zarrfeed.commands.demo import PARTITION_TAG, run
from zarrfeed.commands.launcher import code_location
with dg.DagsterInstance.get() as instance:
    with code_location(Path(os.environ["DAGSTER_HOME"]), instance) as launcher:
        run(launcher, "ct_build", "ct", sys.argv[1], tags={PARTITION_TAG: sys.argv[1]})
"""


@contextlib.contextmanager
def backend(kind: str):
    if kind == "sqlite":
        yield SQLITE, {}
    else:
        with postgres_database() as env:
            yield POSTGRES, env


@pytest.mark.parametrize(("kind", "launcher"), [("postgres", "dg launch"), ("sqlite", "demo")])
def test_a_killed_run_is_failed_and_frees_its_slot(tmp_path, monkeypatch, kind, launcher):
    raw = ct_raw(tmp_path / "raw", 1)
    home = tmp_path / "home"
    home.mkdir()
    with backend(kind) as (dagster_yaml, pg_env):
        (home / "dagster.yaml").write_text(dagster_yaml)
        store = str(tmp_path / "store.zarr")
        env = {**os.environ, **pg_env, "DAGSTER_HOME": str(home), "ZARRFEED_RAW": str(raw),
               "ZARRFEED_STORE": store, "ZARRFEED_MODELS": str(tmp_path / "models")}  # fmt: skip
        for name, value in pg_env.items():  # this process opens the same instance
            monkeypatch.setenv(name, value)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            (key,) = register(instance, raw, store)
            # Raw ingest hashes a file of 8 GiB of zeros: the run is caught mid-step.
            restore = hold([next(raw.rglob(f"{key}.nii.gz"))], tmp_path / "aside")
            if launcher == "demo":
                args = [sys.executable, "-c", DEMO_RUN, key]
            else:
                dg_cli = Path(sys.executable).with_name("dg")
                args = [dg_cli, "launch", "-m", "zarrfeed.definitions", "--job", "ct_build",
                        "--partition", key]  # fmt: skip
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            proc = subprocess.Popen(args, cwd=tmp_path, env=env, start_new_session=True, **quiet)
            webserver = None
            try:
                run = wait_for(lambda: started(instance), 120, "a started run with its host")
                pid = wait_for(
                    lambda: orchestrator_pid(instance.get_run_by_id(run.run_id)), 30, "its pid"
                )
                context = dg.build_sensor_context(instance=instance)
                assert "live process" in dead_runs(context).skip_message  # alive: left alone
                assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
                if launcher == "demo":  # the run worker, its code server and webserver at once
                    webserver = os.getpgid(pid)  # the webserver's session
                    os.killpg(webserver, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
                if pid == proc.pid:
                    proc.wait()  # reaped, as a shell or supervisor would
                killed = time.monotonic()
                wait_for(lambda: failed(instance, run.run_id), 60, "the dead run failed", 5)
                assert time.monotonic() - killed < 60
                assert instance.get_runs_count(dg.RunsFilter(statuses=IN_PROGRESS)) == 0
                cause = partition_states(instance, CT, [key])[key]  # as `status` says it
                assert f"pid {pid}" in cause and "is gone" in cause, cause
            finally:
                os.killpg(proc.pid, signal.SIGKILL)  # orphaned step processes too
                proc.wait()
                if webserver is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(webserver, signal.SIGKILL)
                restore()


def test_a_step_names_the_process_that_orchestrates_its_run(monkeypatch):
    """In process, that process; in a child Python's multiprocessing started (Dagster's
    multiprocess executor), its parent, unless its run runs in process; in a Celery worker,
    none."""
    import multiprocessing
    import types

    assert orchestrating_pid() == os.getpid()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(orchestrating_pid) == os.getpid()
        # a run worker a code server started, its steps in its own process (the demo's runs)
        assert pool.apply(orchestrating_pid, (True,)) == pool.apply(os.getpid)
    monkeypatch.setitem(sys.modules, "celery", types.SimpleNamespace(current_task=object()))
    assert orchestrating_pid() is None


def test_a_run_in_process_is_told_by_its_run_config():
    def run(config: dict) -> dg.DagsterRun:
        return dg.DagsterRun(job_name="ct_build", run_config=config)

    assert runs_in_process(run({"execution": {"config": {"in_process": True}}}))
    assert not runs_in_process(run({"execution": {"config": {"in_process": False}}}))
    assert not runs_in_process(run({})) and not runs_in_process(None)


def started(instance: dg.DagsterInstance) -> dg.DagsterRun | None:
    runs = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
    return next((r for r in runs if r.tags.get(HOST_TAG) == host_identity()), None)


def failed(instance: dg.DagsterInstance, run_id: str) -> bool:
    dead_runs(dg.build_sensor_context(instance=instance))  # one tick of the sensor
    return instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.FAILURE
