"""The machine's services (Postgres, Redis on 127.0.0.1) and a Dagster deployment started the
way deploy/README.md says: code server, webserver, daemon and Celery workers as separate
processes, each in its own process group, stopped by PID.

Shared by the deployment tests and ``benchmarks/build.py``.  A service that does not answer
is an error that names it and the command that starts it: these tests are part of the
product, so they fail rather than skip.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PING = """
import sys, time
from celery import Celery
broker, timeout, names = sys.argv[1], float(sys.argv[2]), set(sys.argv[3:])
app = Celery(broker=broker)
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    seen = {h.split("@")[0] for reply in app.control.ping(timeout=1.0) for h in reply}
    if names <= seen:
        sys.exit(0)
    print("answered:", sorted(seen), flush=True)
    time.sleep(0.5)
sys.exit(1)
"""
HOST = "127.0.0.1"
PG_PORT, REDIS_PORT = 5432, 6379
START = {
    "PostgreSQL": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    "Redis": 'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" '
    "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log",
}
LOCATION = "zarrfeed"


def semaphores() -> set[str]:
    """The named semaphores of multiprocessing's spawn and forkserver contexts now."""
    return set(glob.glob("/dev/shm/sem.mp-*"))


def remove_orphaned_semaphores(before: set[str]) -> None:
    """Remove the named semaphores made since ``before`` that no live process maps.

    A process group stopped by signal can take its multiprocessing resource tracker with it,
    and the tracker is what unlinks the semaphores of its spawn and forkserver queues and
    events (a machine that is shut down loses its tmpfs with them).  Mappings are matched by
    inode: glibc creates a semaphore under a temporary name, maps it, then links it to its
    final name, so its creator's maps show the temporary name.  Only files of this user are
    candidates; processes whose maps this user cannot read (another user's, the container's
    init) are not ours to have made them.
    """
    candidates = {}
    for path in semaphores() - before:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path)
            if st.st_uid == os.getuid():
                candidates[path] = st.st_ino
    if not candidates:
        return
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # ended, or not ours to read
            continue
        for line in lines:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                mapped.add(int(fields[4]))
    for path, inode in candidates.items():
        if inode not in mapped:
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(path)


def default_signals() -> None:
    """SIGINT and SIGTERM at their defaults in a child about to exec, as a service manager
    or a shell starts a process.  A pytest-xdist worker runs with SIGINT ignored, an ignored
    signal stays ignored across exec, and Dagster's CLIs give SIGTERM SIGINT's handler: a code
    server or ``dg dev`` started from a worker ignored SIGTERM, and each stop waited 30 s for
    SIGKILL."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class ServiceDown(RuntimeError):
    """A service the deployment needs is not answering."""


def require(service: str, port: int) -> None:
    try:
        socket.create_connection((HOST, port), timeout=3).close()
    except OSError as exc:
        raise ServiceDown(
            f"{service} is not answering on {HOST}:{port} ({exc}); start it with: {START[service]}"
        ) from None


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_database() -> Iterator[dict[str, str]]:
    """A fresh database ``zf_<random>``, dropped at the end; yields the DAGSTER_PG_* variables
    that deploy/dagster.yaml reads."""
    import psycopg2

    require("PostgreSQL", PG_PORT)
    name = f"zf_{secrets.token_hex(6)}"
    admin = psycopg2.connect(host=HOST, port=PG_PORT, user="postgres", dbname="postgres")
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        yield {
            "DAGSTER_PG_HOST": HOST,
            "DAGSTER_PG_PORT": str(PG_PORT),
            "DAGSTER_PG_USERNAME": "postgres",
            "DAGSTER_PG_PASSWORD": "",
            "DAGSTER_PG_DB": name,
        }
    finally:
        with admin.cursor() as cur:  # FORCE: connections of killed processes linger
            cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@contextlib.contextmanager
def redis_database() -> Iterator[dict[str, str]]:
    """A Redis database (1-15) claimed for this deployment alone, so that other test runs on
    the machine never take its Celery tasks; yields the ZARRFEED_CELERY_* variables."""
    import redis

    require("Redis", REDIS_PORT)
    claims = redis.Redis(host=HOST, port=REDIS_PORT, db=0)
    token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    for db in random.sample(range(1, 16), 15):
        if claims.set(f"zarrfeed-tests:db:{db}", token, nx=True, ex=3600):
            break
    else:
        raise ServiceDown("all 15 Redis databases are claimed by other test runs; retry later")
    url = f"redis://{HOST}:{REDIS_PORT}/{db}"
    redis.Redis(host=HOST, port=REDIS_PORT, db=db).flushdb()
    try:
        yield {"ZARRFEED_CELERY_BROKER": url, "ZARRFEED_CELERY_BACKEND": url}
    finally:
        redis.Redis(host=HOST, port=REDIS_PORT, db=db).flushdb()
        claims.delete(f"zarrfeed-tests:db:{db}")


def instance_yaml(base: Mapping[str, Any], **runs_and_monitoring: Any) -> str:
    """``base`` (a parsed dagster.yaml) with test-sized run limits and monitoring intervals."""
    config = json.loads(json.dumps(base))
    if "max_concurrent_runs" in runs_and_monitoring:
        limit = runs_and_monitoring.pop("max_concurrent_runs")
        config.setdefault("concurrency", {}).setdefault("runs", {})["max_concurrent_runs"] = limit
    config.setdefault("run_monitoring", {}).update(runs_and_monitoring)
    return yaml.safe_dump(config, sort_keys=False)


class Deployment:
    """Dagster as a service on 127.0.0.1: one code server (``dagster code-server start``),
    the webserver and the daemon reaching it through a gRPC workspace, and Celery workers.

    ``env`` is every process's environment (DAGSTER_HOME, ZARRFEED_*, the Postgres and
    broker variables); output goes to ``<home>/process_logs/<name>.log`` (not ``logs/``:
    Dagster's telemetry uploader owns ``$DAGSTER_HOME/logs`` and moves it away).
    """

    def __init__(
        self,
        home: Path,
        env: Mapping[str, str],
        location: Sequence[str] = ("-m", "zarrfeed.definitions"),
    ) -> None:
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # dagster-celery runs `celery`
        self.home, self.location = home, location
        self.env = {**os.environ, **env, "DAGSTER_HOME": str(home), "PATH": path}
        self.logs = home / "process_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.code_port, self.web_port = free_port(), free_port()
        self.workspace = home / "workspace.yaml"
        self.workspace.write_text(
            yaml.safe_dump(
                {
                    "load_from": [
                        {
                            "grpc_server": {
                                "host": HOST,
                                "port": self.code_port,
                                "location_name": LOCATION,
                            }
                        }
                    ]
                }
            )
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self.semaphores = semaphores()

    # -- processes ------------------------------------------------------------------------

    def spawn(self, name: str, *cmd: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "a") as log:
            proc = subprocess.Popen(
                [str(c) for c in cmd],
                cwd=self.home,  # not the repository: the dagster CLIs load a .env from the cwd
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped with its children
                preexec_fn=default_signals,
            )
        self.procs[name] = proc
        return proc

    def start_code_server(self) -> None:
        self.spawn("code_server", BIN / "dagster", "code-server", "start", *self.location,
                   "-h", HOST, "-p", str(self.code_port), "--location-name", LOCATION)  # fmt: skip

    def start_webserver(self) -> None:
        self.spawn("webserver", BIN / "dagster-webserver", "-h", HOST, "-p", str(self.web_port),
                   "-w", self.workspace)  # fmt: skip

    def start_daemon(self) -> None:
        self.spawn("daemon", BIN / "dagster-daemon", "run", "-w", self.workspace)

    def start_worker(self, name: str) -> None:
        """One Celery worker process (one step at a time) on the ``dagster`` queue."""
        self.spawn(name, BIN / "dagster-celery", "worker", "start", "-A", "dagster_celery.app",
                   "-y", REPO / "deploy" / "celery.yaml", "-q", "dagster", "-n", name,
                   "--", "--concurrency=1")  # fmt: skip

    def start(self, workers: Sequence[str] = ()) -> None:
        """Code server, webserver, daemon and ``workers``, ready, every sensor stopped: the
        caller launches exactly the runs it checks."""
        self.start_code_server()
        self.start_webserver()
        self.start_daemon()
        for name in workers:
            self.start_worker(name)
        self.wait_ready(workers)
        self.stop_sensors()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal ``name``'s whole process group and reap it."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        """Stop every process, as a machine shutting down (its tmpfs leftovers go too)."""
        for name in reversed(list(self.procs)):
            self.kill(name, signal.SIGTERM)
        remove_orphaned_semaphores(self.semaphores)

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
            for p in sorted(self.logs.glob("*.log"))
        )

    # -- readiness ------------------------------------------------------------------------

    def wait_ready(self, workers: Sequence[str] = (), timeout: float = 120) -> None:
        """Until the webserver serves the loaded code location, the daemon's run queue,
        monitoring and retry daemons beat, and every worker answers a ping."""

        self.wait_until(self.code_server_id, timeout, "the code location to load in the webserver")
        wanted = {"QUEUED_RUN_COORDINATOR", "MONITORING", "EVENT_LOG_CONSUMER", "BACKFILL"}

        def daemons() -> bool:
            data = self.graphql(
                "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy } } } }"
            )
            statuses = data["instance"]["daemonHealth"]["allDaemonStatuses"]
            return wanted <= {s["daemonType"] for s in statuses if s["healthy"]}

        self.wait_until(daemons, timeout, f"the daemon ({', '.join(sorted(wanted))})")
        if workers:
            self.wait_workers(workers, timeout)

    def code_server_id(self) -> str | None:
        """The id of the code server the webserver serves the location from; None while it
        serves none.  A restarted code server has a new id."""
        try:
            data = self.graphql(
                "{ workspaceOrError { ... on Workspace { locationEntries { locationOrLoadError {"
                " ... on RepositoryLocation { serverId } } } } } }"
            )
        except OSError:
            return None
        entries = data["workspaceOrError"]["locationEntries"]
        return next((e["locationOrLoadError"].get("serverId") for e in entries), None)

    def wait_new_code_server(self, old: str | None, timeout: float = 120) -> None:
        """Until the webserver's watch thread has moved the location to a code server other
        than ``old`` (a reload request would restart the new one once more)."""
        self.wait_until(
            lambda: self.code_server_id() not in (None, old), timeout, "the restarted code server"
        )

    def wait_workers(self, names: Sequence[str], timeout: float = 120) -> None:
        """Until every worker in ``names`` answers a Celery ping.  Pinged from a child
        process: a Celery app in this one leaves kombu's after-fork hook behind, which blocks
        every later fork of the test process (other tests' DataLoader workers) for ever on a
        BRPOP while closing the inherited Redis channel."""
        ping = subprocess.run(
            [sys.executable, "-c", PING, self.env["ZARRFEED_CELERY_BROKER"], str(timeout),
             *names],
            capture_output=True, text=True, timeout=timeout + 60,
        )  # fmt: skip
        if ping.returncode:
            raise AssertionError(
                f"Celery workers {list(names)} never answered a ping in {timeout:.0f}s: "
                f"{ping.stdout[-500:]}{ping.stderr[-1500:]}\n{self.log_tail()}"
            )

    def wait_until(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """:func:`wait_for`, failing with the tail of every process's log."""
        try:
            return wait_for(predicate, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None

    # -- GraphQL (the webserver's public API) -----------------------------------------------

    def graphql(self, query: str, variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(
            f"http://{HOST}:{self.web_port}/graphql",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # the body says why: a PythonError, bad query
            body = exc.read()
            try:
                payload = json.loads(body)
            except ValueError:
                raise AssertionError(f"GraphQL HTTP {exc.code}: {body[:2000]!r}") from None
        if payload.get("errors"):
            raise AssertionError(f"GraphQL errors: {payload['errors']}")
        return payload["data"]

    def launch_run(
        self,
        job: str,
        partition: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> str:
        """Submit ``job`` (one partition of it) to the run queue; returns the run id."""
        all_tags = {**({"dagster/partition": partition} if partition else {}), **(tags or {})}
        data = self.graphql(
            """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
                 __typename ... on LaunchRunSuccess { run { runId } }
                 ... on PythonError { message } ... on RunConfigValidationInvalid {
                 errors { message } } } }""",
            {
                "p": {
                    "selector": self.selector(jobName=job),
                    "runConfigData": dict(run_config or {}),
                    "executionMetadata": {
                        "tags": [{"key": k, "value": v} for k, v in all_tags.items()]
                    },
                }
            },
        )["launchRun"]
        assert data["__typename"] == "LaunchRunSuccess", data
        return data["run"]["runId"]

    def launch_backfill(
        self, job: str, partitions: list[str], run_config: Mapping[str, Any] | None = None
    ) -> str:
        """A backfill of ``job`` over ``partitions`` (runs over ranges of the family's backfill
        policy's size, via the queue)."""
        data = self.graphql(
            """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
                 __typename ... on LaunchBackfillSuccess { backfillId }
                 ... on PythonError { message } } }""",
            {
                "p": {
                    "selector": {
                        "partitionSetName": f"{job}_partition_set",
                        "repositorySelector": self.selector(),
                    },
                    "partitionNames": partitions,
                    "runConfigData": dict(run_config or {}),
                }
            },
        )["launchPartitionBackfill"]
        assert data["__typename"] == "LaunchBackfillSuccess", data
        return data["backfillId"]

    def stop_sensors(self) -> list[str]:
        """Stop every sensor (discovery, automation): a test launches exactly the runs it checks."""
        data = self.graphql(
            """query($r: RepositorySelector!) { repositoryOrError(repositorySelector: $r) {
                 ... on Repository { sensors { id name } } } }""",
            {"r": self.selector()},
        )
        sensors = data["repositoryOrError"]["sensors"]
        for sensor in sensors:

            def stopped(sensor_id: str = sensor["id"]) -> bool:
                """Stopped; a PythonError when the daemon's first tick writes the sensor's
                state at the same moment (seen once on Postgres): try again."""
                result = self.graphql(
                    "mutation($id: String!) { stopSensor(id: $id) { __typename"
                    " ... on PythonError { message } } }",
                    {"id": sensor_id},
                )["stopSensor"]
                return result["__typename"] == "StopSensorMutationResult"

            self.wait_until(stopped, 30, f"sensor {sensor['name']} to stop")
        return [s["name"] for s in sensors]

    def set_pool_limit(self, pool: str, limit: int) -> None:
        """What ``dagster instance concurrency set POOL LIMIT`` does (deploy/README.md)."""
        data = self.graphql(
            "mutation($k: String!, $n: Int!) "
            "{ setConcurrencyLimit(concurrencyKey: $k, limit: $n) }",
            {"k": pool, "n": limit},
        )
        assert data["setConcurrencyLimit"] is True, data

    def wait_backfill(self, backfill: str, runs: int, timeout: float = 600) -> list[Any]:
        """The backfill's runs once all ``runs`` of them have finished."""
        import dagster as dg

        with self.instance() as instance:

            def finished() -> list[Any] | None:
                found = instance.get_runs(
                    filters=dg.RunsFilter(tags={"dagster/backfill": backfill})
                )
                return found if len(found) == runs and all(r.is_finished for r in found) else None

            return self.wait_until(finished, timeout, f"the {runs} runs of backfill {backfill}")

    @staticmethod
    def selector(**job: str) -> dict[str, str]:
        """The code location's repository, and ``jobName=`` or ``pipelineName=`` if given."""
        return {"repositoryLocationName": LOCATION, "repositoryName": "__repository__", **job}

    # -- the instance, as the processes see it -------------------------------------------

    @contextlib.contextmanager
    def instance(self) -> Iterator[Any]:
        """The deployment's DagsterInstance in this process (its dagster.yaml reads the
        environment only while it is opened)."""
        import dagster as dg

        keys = [k for k in self.env if k.startswith(("DAGSTER_", "ZARRFEED_"))]
        saved = {k: os.environ.get(k) for k in keys}
        os.environ.update({k: self.env[k] for k in keys})
        try:
            instance = dg.DagsterInstance.get()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        with instance:
            yield instance


# -- additions for the production-shape benchmark and UI test ------------------------------


def launch_asset_backfill(
    d: Deployment,
    assets: Sequence[str],
    partitions: Sequence[str],
    tags: Mapping[str, str] | None = None,
) -> str:
    """A backfill of ``assets`` (asset key strings) over ``partitions`` as the UI's
    Materialize dialog sends it: ``launchPartitionBackfill`` with an asset selection.  The
    webserver only stores it; the backfill daemon's next tick makes the runs, over ranges of
    the assets' backfill policy."""
    data = d.graphql(
        """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
             __typename ... on LaunchBackfillSuccess { backfillId }
             ... on PythonError { message } } }""",
        {
            "p": {
                "assetSelection": [{"path": a.split("/")} for a in assets],
                "partitionNames": list(partitions),
                "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()],
            }
        },
    )["launchPartitionBackfill"]
    assert data["__typename"] == "LaunchBackfillSuccess", data
    return data["backfillId"]


def set_sensor_cursor(d: Deployment, name: str, cursor: str) -> None:
    """Set sensor ``name``'s cursor, as its page in the UI does."""
    data = d.graphql(
        "mutation($s: SensorSelector!, $c: String) { setSensorCursor(sensorSelector: $s,"
        " cursor: $c) { __typename ... on PythonError { message } } }",
        {"s": {**d.selector(), "sensorName": name}, "c": cursor},
    )["setSensorCursor"]
    assert data["__typename"] == "Sensor", data


def start_sensor(d: Deployment, name: str) -> None:
    """Start sensor ``name``, as its toggle in the UI does."""
    data = d.graphql(
        "mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) { __typename"
        " ... on PythonError { message } } }",
        {"s": {**d.selector(), "sensorName": name}},
    )["startSensor"]
    assert data["__typename"] == "Sensor", data


def restart_daemon(d: Deployment, dagster_yaml: str, timeout: float = 120) -> None:
    """Stop the daemon, write ``dagster_yaml`` as the instance's configuration, start the daemon
    again and wait until each of its daemons has beaten since (run processes started from now
    on read the new file too)."""
    d.kill("daemon", signal.SIGTERM)
    (d.home / "dagster.yaml").write_text(dagster_yaml)
    since = time.time()
    d.start_daemon()
    wanted = {"QUEUED_RUN_COORDINATOR", "SENSOR", "BACKFILL"}

    def beating() -> bool:
        data = d.graphql(
            "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy"
            " lastHeartbeatTime } } } }"
        )
        statuses = data["instance"]["daemonHealth"]["allDaemonStatuses"]
        fresh = {s["daemonType"] for s in statuses if (s["lastHeartbeatTime"] or 0) > since}
        return wanted <= fresh

    d.wait_until(beating, timeout, "the restarted daemon's first heartbeats")


PGBOUNCER = ("/usr/sbin/pgbouncer", "apt-get install -y pgbouncer")


@contextlib.contextmanager
def pgbouncer(folder: Path) -> Iterator[int]:
    """PgBouncer on 127.0.0.1 (a free port, yielded) in session mode in front of the
    machine's Postgres, stopped by PID.

    Dagster's Postgres storages open a new connection for every write (SQLAlchemy's
    ``NullPool``), and each costs Postgres a backend process; PgBouncer hands the client an
    idle server connection instead.  Session mode keeps every session's semantics
    (``LISTEN``, prepared statements), so Dagster needs no change but the port."""
    exe = Path(shutil.which("pgbouncer") or PGBOUNCER[0])
    if not exe.exists():
        raise ServiceDown(f"PgBouncer is not installed: {PGBOUNCER[1]}")
    require("PostgreSQL", PG_PORT)
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "users.txt").write_text('"postgres" ""\n')
    ini = folder / "pgbouncer.ini"
    ini.write_text(
        f"[databases]\n* = host={HOST} port={PG_PORT}\n\n[pgbouncer]\n"
        f"listen_addr = {HOST}\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\npool_mode = session\n"
        "max_client_conn = 2000\ndefault_pool_size = 50\n"
        # dagster-postgres passes statement_timeout as a startup option in the webserver
        "ignore_startup_parameters = extra_float_digits,options\n"
    )
    # PgBouncer refuses to run as root: it reads its files first, then becomes postgres.
    user = ["-u", "postgres"] if os.getuid() == 0 else []
    with open(folder / "pgbouncer.log", "a") as log:
        proc = subprocess.Popen([str(exe), *user, str(ini)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:

        def answers() -> bool:
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                return True
            except OSError:
                if proc.poll() is not None:
                    raise ServiceDown(
                        f"PgBouncer exited: {(folder / 'pgbouncer.log').read_text()[-1500:]}"
                    ) from None
                return False

        wait_for(answers, 30, f"PgBouncer on {HOST}:{port}")
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
