"""Runs launched the way the UI launches them, for ``zarrfeed demo`` and ``zarrfeed hub``.

A ``dagster-webserver`` on 127.0.0.1 serves the code location ``workspace.yaml`` loads, the
one ``dg dev -w workspace.yaml`` shows; each run is submitted through its GraphQL API
(``dagster_graphql.DagsterGraphQLClient``), so the webserver records the run with that code
location as its origin (the UI lists it under its job and re-executes it as its own) and
Dagster's run launcher executes it in a run worker of the code server, as for a run launched
from the UI.  No daemon runs: the webserver's instance is the caller's, with Dagster's
``DefaultRunCoordinator`` in place of the queue, so a run starts as it is submitted.

The run worker's steps tag the run with their host and the run worker's pid
(:mod:`zarrfeed.jobs.liveness`), so the ``dead_runs`` sensor judges the process that really
runs it.  The webserver is in a session of its own (a Ctrl-C reaches the caller alone, which
terminates the run in flight through the API) and gets SIGTERM when its caller dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:  # dagster (~1.5 s to import) is the runs' and the webserver's, not the CLI's
    import dagster as dg

REPO = Path(__file__).resolve().parents[2]
WORKSPACE = REPO / "workspace.yaml"
START_TIMEOUT_S = 180  # the webserver loads the code location (imports torch) before serving
STOP_TIMEOUT_S = 60  # a terminated run's worker stops between steps
POLL_S = 0.2


@dataclass
class Finished:
    """A run that ended: its record, its Dagster events, seconds from submission to end."""

    run: dg.DagsterRun
    events: list[dg.DagsterEvent]
    seconds: float


class Launcher:
    """Submits runs to the webserver and waits for them in ``instance`` (the same storage);
    ``server``, the webserver's process, is watched while a run is waited for, and
    ``until_serving`` called before the first submission."""

    def __init__(
        self,
        client: Any,
        instance: dg.DagsterInstance,
        server: subprocess.Popen | None = None,
        until_serving: Callable[[], None] | None = None,
    ) -> None:
        self.client = client  # a dagster_graphql.DagsterGraphQLClient
        self.instance = instance
        self.server = server
        self.until_serving = until_serving

    def run(self, job: str, **options: Any) -> Finished:
        """Run ``job`` (``submit_job_execution``'s options: ``tags``, ``run_config``,
        ``asset_selection``) to its end.  A Ctrl-C terminates the run, waits for it to stop
        and is raised again."""
        [finished] = self.runs([(job, options)])
        return finished

    def runs(
        self, requests: Iterable[tuple[str, dict[str, Any]]], at_once: int = 1
    ) -> Iterator[Finished]:
        """Each ``(job, options)`` request run to its end, ``at_once`` in flight (the next
        submitted as soon as any one ends, so that its process starts while the others
        work), yielded in the order requested.  A Ctrl-C terminates every run in flight,
        waits for them to stop and is raised again."""
        if self.until_serving is not None:  # where a Ctrl-C stops the wait
            self.until_serving()
            self.until_serving = None
        pending = iter(requests)
        flight: list[str] = []  # submitted, not ended
        order: list[str] = []  # submitted, not yielded
        ended: dict[str, Finished] = {}
        try:
            while True:
                while len(flight) < at_once and (request := next(pending, None)) is not None:
                    with sigint_held():  # a run submitted is in flight, which a Ctrl-C ends
                        flight.append(self._submit(*request))
                    order.append(flight[-1])
                if not order:
                    return
                if order[0] in ended:
                    yield ended.pop(order.pop(0))
                    continue
                run = self._first_ended(flight, timeout=None)
                flight.remove(run.run_id)
                ended[run.run_id] = self._outcome(run)
        except (KeyboardInterrupt, GeneratorExit):  # a Ctrl-C here or where the runs go
            for run_id in flight:
                self._terminate(run_id)
            raise

    def _submit(self, job: str, options: dict[str, Any]) -> str:
        run_id = self.client.submit_job_execution(job, **options)
        if self.instance.get_run_by_id(run_id) is None:
            raise RuntimeError(
                f"the webserver launched run {run_id} of {job} into an instance other than "
                f"{self.instance.root_directory}: its dagster.yaml names other storage"
            )
        return run_id

    def _outcome(self, run: dg.DagsterRun) -> Finished:
        record = self.instance.get_run_record_by_id(run.run_id)
        logs = self.instance.all_logs(run.run_id)
        events = [e.dagster_event for e in logs if e.dagster_event is not None]
        return Finished(run, events, record.end_time - record.create_timestamp.timestamp())

    def _terminate(self, run_id: str) -> None:
        """Terminate the run unless it has ended, and wait for it to stop."""
        from dagster_graphql import DagsterGraphQLClientError

        try:
            self.client.terminate_run(run_id)
        except DagsterGraphQLClientError:
            if not self.instance.get_run_by_id(run_id).is_finished:
                raise
        self._first_ended([run_id], timeout=STOP_TIMEOUT_S)

    def _first_ended(self, run_ids: list[str], timeout: float | None) -> dg.DagsterRun:
        """The first of ``run_ids`` found ended, waiting for one as long as ``timeout``."""
        import dagster as dg

        deadline = None if timeout is None else time.monotonic() + timeout
        what = f"runs {', '.join(run_ids)} were" if run_ids[1:] else f"run {run_ids[0]} was"
        while True:
            runs = self.instance.get_runs(dg.RunsFilter(run_ids=run_ids))
            ended = [r for r in runs if r.is_finished]
            if ended:
                return ended[0]
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{what} still in progress after {timeout:.0f} s")
            if self.server is not None and self.server.poll() is not None:
                raise RuntimeError(
                    f"dagster-webserver for {WORKSPACE} exited with status "
                    f"{self.server.returncode} while {what} in progress; its output is in the log"
                )
            time.sleep(POLL_S)


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """A Ctrl-C (SIGINT) arriving in the block is delivered as the block ends.  Held by
    Python's handler, not by the thread's signal mask: the kernel hands a signal the main
    thread blocks to any other thread (a timer's, a library's), and Python then runs the
    handler in the main thread all the same."""
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def launcher_config(home: Path) -> dict[str, Any]:
    """The instance configuration of ``home`` (its ``dagster.yaml``), its storage named
    explicitly (where Dagster's defaults put it under ``home``) and with Dagster's
    ``DefaultRunCoordinator``: a run launches as it is submitted, with no daemon."""
    path = home / "dagster.yaml"
    config = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping of instance settings, found {config!r}")
    base = str(home.resolve())
    defaults = {
        "storage": {"sqlite": {"base_dir": base}},
        "local_artifact_storage": {
            "module": "dagster.core.storage.root",
            "class": "LocalArtifactStorage",
            "config": {"base_dir": base},
        },
        "compute_logs": {
            "module": "dagster.core.storage.local_compute_log_manager",
            "class": "LocalComputeLogManager",
            "config": {"base_dir": str(home.resolve() / "storage")},
        },
    }
    legacy = {"run_storage", "event_log_storage", "schedule_storage"} & config.keys()
    if legacy and "storage" not in config:
        defaults.pop("storage")  # the three storages named one by one
    return {
        **defaults,
        **config,
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": "DefaultRunCoordinator",
        },
    }


@contextlib.contextmanager
def code_location(home: Path, instance: dg.DagsterInstance) -> Iterator[Launcher]:
    """A webserver serving ``workspace.yaml`` on the storage of the instance in ``home``
    for the block; its output goes to this process's stdout.  It starts loading the code
    location (~20 s on two cores) as the block starts, while the caller prepares its runs;
    the first submission waits until it serves."""
    folder = home / "launcher"  # the webserver's DAGSTER_HOME: only its dagster.yaml
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dagster.yaml").write_text(yaml.safe_dump(launcher_config(home)))
    port = free_port()
    cmd = [Path(sys.executable).with_name("dagster-webserver"), "-w", str(WORKSPACE),
           "-h", "127.0.0.1", "-p", str(port)]  # fmt: skip
    sys.stdout.flush()
    proc = subprocess.Popen(
        cmd,
        cwd=folder,  # not the repository: the dagster CLI lets a working folder's .env win
        env={**os.environ, "DAGSTER_HOME": str(folder.resolve())},
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=terminate_with_parent(os.getpid()),
    )
    try:
        from dagster_graphql import DagsterGraphQLClient

        client = DagsterGraphQLClient("127.0.0.1", port_number=port)
        yield Launcher(client, instance, proc, lambda: wait_until_serving(proc, port))
    finally:
        stop(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, port: int) -> None:
    """Return once the webserver answers (it has loaded the code location by then)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"dagster-webserver for {WORKSPACE} exited with status {proc.returncode} "
                "before serving; its output is in the log"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(
        f"dagster-webserver for {WORKSPACE} did not serve within {START_TIMEOUT_S} s"
    )


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the webserver's session (it and its code server), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def terminate_with_parent(parent: int) -> Any:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when ``parent`` dies (otherwise a
    killed caller would leave its webserver serving forever); elsewhere none."""
    if not sys.platform.startswith("linux"):
        return None

    def arm() -> None:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took hold
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
