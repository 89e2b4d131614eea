"""Orchestration at CT-RATE's size in the production shape: 50,000 dynamic partitions
registered in a Postgres instance, a subset of them built through the daemon, the run queue
and Celery workers, launched the two ways a user launches builds: a backfill as the UI sends
it (GraphQL ``launchPartitionBackfill`` against the webserver) and a sensor requesting
ranges as the discovery sensor does.  The work is a sleep (none by default), so what is
measured is Dagster's part: the daemon's tick, run creation with its planned events, the
queue, the run's start, step dispatch and the per-partition records.

Each case is one instance configuration (``deploy/dagster.yaml`` with some levers set) and
one size of runs; the cases run one after another on one deployment (the daemon restarted
with each configuration), each over partitions of its own.  Imported by ``scale.py
--production``.
"""

import argparse
import contextlib
import copy
import os
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from _bench import bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from services import (
    PGBOUNCER,
    REPO,
    Deployment,
    launch_asset_backfill,
    pgbouncer,
    postgres_database,
    redis_database,
    restart_daemon,
    set_sensor_cursor,
    start_sensor,
)

DEFS = Path(__file__).with_name("production_defs.py")
REGISTERED = 50_000  # CT-RATE's volumes: every one a partition of the instance
STEPS = ("raw", "volumes", "index")
ASSETS = ("raw_scan", "hu", "windows", "sparse", "patches")
WORKERS = ("w1", "w2")
TODAY_PER_RUN = 16  # zarrfeed.batching.per_run on this machine's 2 cores (its minimum)

# Each lever: where it sits in dagster.yaml, the value the repository shipped before it was
# measured ("today"), and the tuned one.  None: the key absent (Dagster's default).
LEVERS: dict[str, tuple[tuple[str, ...], Any, Any]] = {
    "dequeue_num_workers": (("run_coordinator", "config", "dequeue_num_workers"), None, 4),
    "max_user_code_failure_retries": (
        ("run_coordinator", "config", "max_user_code_failure_retries"), None, 3),
    "max_concurrent_runs": (("concurrency", "runs", "max_concurrent_runs"), 8, 16),
    "backfill_tag_limit": (("concurrency", "runs", "tag_concurrency_limits"),
                           [{"key": "dagster/backfill", "limit": 6}],
                           [{"key": "dagster/backfill", "limit": 14}]),
    "sensors_threads": (("sensors",), None,
                        {"use_threads": True, "num_workers": 4, "num_submit_workers": 8}),
    "schedules_threads": (("schedules",), None,
                          {"use_threads": True, "num_workers": 4, "num_submit_workers": 8}),
    "backfills_threads": (("backfills",), None,
                          {"use_threads": True, "num_workers": 2, "num_submit_workers": 8}),
}  # fmt: skip


# The levers measured one by one by leaving them out of the tuned set (the sensors' threads
# with the sensor; the schedules' and backfills' threads have nothing to act on here: no
# schedule runs, and an asset backfill creates its runs in one thread whatever they are).
LOOSE = ("dequeue_num_workers", "max_concurrent_runs", "backfill_tag_limit")


def instance_config(base: Mapping[str, Any], tuned: set[str]) -> str:
    """``base`` with the levers in ``tuned`` at their tuned value and the others at today's."""
    config = copy.deepcopy(dict(base))
    for name, (path, today, better) in LEVERS.items():
        value = better if name in tuned else today
        node = config
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = copy.deepcopy(value)
    return yaml.safe_dump(config, sort_keys=False)


@dataclass
class Case:
    name: str
    tuned: set[str]  # levers at their tuned value
    per_run: int
    how: str = "backfill"  # or "sensor"
    pool: int = 8  # zarrfeed_io's limit (the raw step's pool)
    pooler: bool = True  # every process reaches Postgres through PgBouncer


@dataclass
class Measured:
    """One case: its partitions, runs and the time each phase took."""

    case: Case
    partitions: int
    runs: int
    wall: float  # launch to the last run's end
    first_build: float  # launch to the first step building
    sustained: float  # partitions / (last run end - first run created)
    phases: dict[str, float] = field(default_factory=dict)  # summed over runs, seconds
    creation: float = 0.0  # first run created to last run enqueued (serial in the daemon)

    @property
    def per_s(self) -> float:
        return self.partitions / self.wall


def timeline(instance: Any, run_ids: list[str], launched: float) -> Measured:
    """The phases of the runs ``run_ids`` from the instance's event log."""
    import dagster as dg

    kinds = {
        dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED,
        dg.DagsterEventType.RUN_ENQUEUED,
        dg.DagsterEventType.RUN_DEQUEUED,
        dg.DagsterEventType.RUN_STARTING,
        dg.DagsterEventType.RUN_START,
        dg.DagsterEventType.STEP_START,
        dg.DagsterEventType.STEP_SUCCESS,
        dg.DagsterEventType.STEP_FAILURE,
    }
    phases = dict.fromkeys(
        ["run creation", "of which planned events", "queue", "run start (process)",
         "step dispatch (between steps)", "steps (records; work is a sleep)", "run end"], 0.0
    )  # fmt: skip
    records = instance.get_run_records(dg.RunsFilter(run_ids=run_ids))
    partitions, created, enqueued, ends, first_step = 0, [], [], [], []
    for record in records:
        run = record.dagster_run
        events: dict[str, list[float]] = {}
        for r in instance.get_records_for_run(run.run_id, of_type=kinds).records:
            events.setdefault(r.event_log_entry.dagster_event_type.name, []).append(
                r.event_log_entry.timestamp
            )
        planned = events.get("ASSET_MATERIALIZATION_PLANNED", [])
        partitions += covered(run)
        made = record.create_timestamp.timestamp()
        if "RUN_ENQUEUED" not in events or "RUN_START" not in events:
            raise AssertionError(
                f"run {run.run_id} ({run.status}) lacks its queue or start events: "
                f"{sorted(events)}; {instance.get_run_stats(run.run_id)}"
            )
        queued = min(events["RUN_ENQUEUED"])
        dequeued = min(events.get("RUN_DEQUEUED", events.get("RUN_STARTING", [queued])))
        started = min(events["RUN_START"])
        step_starts = sorted(events.get("STEP_START", []))
        step_ends = sorted(events.get("STEP_SUCCESS", []) + events.get("STEP_FAILURE", []))
        end = record.end_time or max(step_ends)
        phases["run creation"] += queued - made
        phases["of which planned events"] += (max(planned) - min(planned)) if planned else 0
        phases["queue"] += dequeued - queued
        phases["run start (process)"] += started - dequeued
        busy = sum(e - s for s, e in zip(step_starts, step_ends, strict=False))
        phases["steps (records; work is a sleep)"] += busy
        last = max(step_ends) if step_ends else started
        phases["step dispatch (between steps)"] += (last - started) - busy
        phases["run end"] += end - last
        created.append(made)
        enqueued.append(queued)
        ends.append(end)
        first_step += step_starts[:1]
    return Measured(
        case=None,  # type: ignore[arg-type]  # set by the caller
        partitions=partitions,
        runs=len(records),
        wall=max(ends) - launched,
        first_build=min(first_step) - launched,
        sustained=partitions / (max(ends) - min(created)),
        phases={**phases, "daemon tick wait": min(created) - launched},
        creation=max(enqueued) - min(created),
    )


def covered(run: Any) -> int:
    """Partitions a run builds: its range (keys are consecutive, numbered) or its one key."""
    start = run.tags.get("dagster/asset_partition_range_start")
    if start is None:
        return 1
    return int(run.tags["dagster/asset_partition_range_end"][5:]) - int(start[5:]) + 1


def wait_runs(d: Deployment, tags: Mapping[str, str], partitions: int, timeout: float) -> list:
    """The runs tagged ``tags`` once they cover ``partitions`` and all ended (polled every
    2 s: the poll's queries load the same Postgres)."""
    import dagster as dg

    deadline = time.monotonic() + timeout
    with d.instance() as instance:
        while time.monotonic() < deadline:
            runs = instance.get_runs(filters=dg.RunsFilter(tags=dict(tags)))
            fresh = [r for r in runs if r.run_id not in SEEN]
            if sum(map(covered, fresh)) >= partitions and all(r.is_finished for r in fresh):
                return fresh
            time.sleep(2)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for runs tagged {dict(tags)} over "
        f"{partitions} partitions\n{d.log_tail()}"
    )


@contextlib.contextmanager
def deployment(work: Path, sizes: list[int], sleep: float, pooler: bool) -> Iterator[Deployment]:
    """The production shape serving production_defs.py (copies of ``sizes`` partitions per
    run), 50,000 partitions registered before the daemon starts, two Celery workers; every
    process reaches Postgres through PgBouncer if ``pooler``."""
    base = yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(postgres_database())
        broker = stack.enter_context(redis_database())
        if pooler:
            pg = {**pg, "DAGSTER_PG_PORT": str(stack.enter_context(pgbouncer(work / "pgb")))}
        env = {**pg, **broker, "ZARRFEED_EXECUTOR": "celery",
               "ZARRFEED_BENCH_PER_RUN": ",".join(map(str, sizes)),
               "ZARRFEED_BENCH_SLEEP": str(sleep)}  # fmt: skip
        home = work / "home"
        home.mkdir(parents=True)
        (home / "dagster.yaml").write_text(instance_config(base, set()))
        d = Deployment(home, env, ("-f", str(DEFS), "-d", str(DEFS.parent)))
        try:
            with d.instance() as instance:
                keys = [key(i) for i in range(REGISTERED)]
                for i in range(0, REGISTERED, 10_000):
                    instance.add_dynamic_partitions("bench_scans", keys[i : i + 10_000])
            d.start(WORKERS)
            yield d
        finally:
            d.stop()


def key(i: int) -> str:
    return f"scan_{i:05d}"


def measure(d: Deployment, case: Case, window: range) -> Measured:
    """Build the partitions at ``window``'s positions as ``case`` says; its phases."""
    d.set_pool_limit("zarrfeed_io", case.pool)
    partitions = [key(i) for i in window]
    if case.how == "backfill":
        launched = time.time()
        backfill = launch_asset_backfill(
            d, [f"p{case.per_run}_{a}" for a in ASSETS], partitions, {"bench/case": case.name}
        )
        tags = {"dagster/backfill": backfill}
    else:
        sensor = f"bench_sensor_p{case.per_run}"
        set_sensor_cursor(d, sensor, f"{window.start}:{window.stop}")
        launched = time.time()
        if sensor not in STARTED:
            start_sensor(d, sensor)
            STARTED.add(sensor)
        tags = {"dagster/sensor_name": sensor}
    runs = wait_runs(d, tags, len(partitions), timeout=180 + 6 * len(partitions))
    ids = [r.run_id for r in runs]
    SEEN.update(ids)  # a sensor's runs of earlier cases are not this case's
    with d.instance() as instance:
        m = timeline(instance, ids, launched)
    m.case = case
    return m


STARTED: set[str] = set()  # sensors started in this deployment
SEEN: set[str] = set()  # runs measured already


def report(m: Measured) -> None:
    p = m.phases
    print(f"# {m.case.name}: {m.partitions} partitions in {m.runs} runs of up to "
          f"{m.case.per_run}, launched by {m.case.how}"
          f"{', Postgres through PgBouncer' if m.case.pooler else ''}: "
          f"{m.wall:.1f} s launch to last run end, "
          f"{m.per_s:.2f} partitions/s ({m.sustained:.2f}/s from the first run created), first "
          f"step {m.first_build:.1f} s after launch; daemon tick wait "
          f"{p['daemon tick wait']:.1f} s; run creation {m.creation:.1f} s wall; summed over "
          "runs: " + ", ".join(f"{k} {v:.1f} s" for k, v in p.items()
                               if k != "daemon tick wait"), flush=True)  # fmt: skip


def production(work: Path, n: int, sleep: float, scan_cpu_s: float, tuned_per_run: int) -> None:
    """The cases, then the BENCH lines: throughput both ways, first build, fleet break-even,
    tuned vs today's defaults, and each lever alone (tuned with that lever at today's value)."""
    base = yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())
    all_tuned = set(LEVERS)
    cases = [
        Case("today", set(), TODAY_PER_RUN, pooler=False),
        Case("today.sensor", set(), TODAY_PER_RUN, how="sensor", pooler=False),
        Case("tuned-pgbouncer", all_tuned, tuned_per_run, pooler=False),
        Case("tuned", all_tuned, tuned_per_run),
        Case("tuned.sensor", all_tuned, tuned_per_run, how="sensor"),
        Case("tuned-per_run", all_tuned, TODAY_PER_RUN),
        Case("tuned+pool1", all_tuned, tuned_per_run, pool=1),
        *[Case(f"tuned-{lever}", all_tuned - {lever}, tuned_per_run) for lever in LOOSE],
        Case("tuned.sensor-sensors_threads", all_tuned - {"sensors_threads"}, tuned_per_run,
             how="sensor"),
    ]  # fmt: skip
    only = os.environ.get("ZARRFEED_BENCH_CASES")  # e.g. "today,tuned" for a short run
    if only:
        cases = [c for c in cases if c.name in only.split(",")]
    sizes = sorted({c.per_run for c in cases})
    found: dict[str, Measured] = {}
    start = 0
    for pooler in (False, True):
        group = [c for c in cases if c.pooler == pooler]
        if not group:
            continue
        if pooler and not (shutil.which("pgbouncer") or Path(PGBOUNCER[0]).exists()):
            print(f"# {', '.join(c.name for c in group)} skipped: PgBouncer is not installed "
                  f"({PGBOUNCER[1]})", flush=True)  # fmt: skip
            continue
        STARTED.clear()
        with deployment(work / f"pooler{int(pooler)}", sizes, sleep, pooler) as d:
            current: str | None = None
            for case in group:
                config = instance_config(base, case.tuned)
                if config != current:
                    restart_daemon(d, config)
                    current = config
                m = found[case.name] = measure(d, case, range(start, start + n))
                start += n
                report(m)
    lines(found, n, sleep, scan_cpu_s)


def lines(found: dict[str, Measured], n: int, sleep: float, scan_cpu_s: float) -> None:
    work = f"work per partition: sleep {sleep:g} s" if sleep else "no work per partition"
    where = (f"measured N={n} of {REGISTERED} registered partitions ({work}), daemon + Postgres "
             f"+ {len(WORKERS)} Celery workers on {os.cpu_count()} shared cores, load "
             f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    for how in ("backfill", "sensor"):
        m = found.get("tuned" if how == "backfill" else "tuned.sensor")
        if m is None:
            continue
        hours = (REGISTERED / m.sustained + m.phases["daemon tick wait"]) / 3600
        bench(f"scale.production_partitions_per_s.{how}", m.sustained, "partitions/s",
              f"tuned{' (PgBouncer)' if m.case.pooler else ''}, {m.runs} runs of up to "
              f"{m.case.per_run}, first run created to last "
              f"run end ({m.per_s:.2f}/s from the launch); {where}; extrapolated: "
              f"{REGISTERED} partitions in {hours:.2f} h")  # fmt: skip
    if "tuned" in found:
        m = found["tuned"]
        bench("scale.production_first_build_s.backfill", m.first_build, "s",
              f"UI backfill launch to the first step building, of which "
              f"{m.phases['daemon tick wait']:.1f} s waiting for the backfill daemon's tick "
              f"(every 30 s, fixed in Dagster); {where}")  # fmt: skip
        workers = m.sustained * scan_cpu_s
        bench("scale.production_fleet_break_even_workers", workers, "cores",
              f"fleet (Celery worker cores) whose builds at {scan_cpu_s:g} s of CPU per "
              f"full-size scan take as long as orchestrating them at "
              f"{m.sustained:.2f} partitions/s; beyond it Dagster sets the time")  # fmt: skip
    if "today" in found and "tuned" in found:
        a, b = found["today"], found["tuned"]
        bench("scale.production_vs_defaults", b.sustained / a.sustained, "x",
              f"tuned {b.sustained:.2f} partitions/s ({b.runs} runs of up to {b.case.per_run}"
              f"{', PgBouncer' if b.case.pooler else ''}) "
              f"/ today's deploy/dagster.yaml and batch size {a.sustained:.2f} partitions/s "
              f"({a.runs} runs of up to {a.case.per_run}, Postgres direct), the same N, in "
              f"this one run; {where}")  # fmt: skip
    for name, m in found.items():
        base = "tuned.sensor" if m.case.how == "sensor" else "tuned"
        if name.startswith(f"{base}-") or name == "tuned+pool1":
            change = name.removeprefix(base)
            bench(f"scale.production_lever.{m.case.how}{change}",
                  found[base].sustained / m.sustained if base in found else 0, "x",
                  f"what the lever gives: tuned {base} partitions/s / the same with {change} "
                  f"({m.sustained:.2f}/s); {where}")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--production`` and its options, for ``scale.py``."""
    add = parser.add_argument
    add("--production", action="store_true",
        help=f"only the production-shape orchestration figures: {REGISTERED} partitions "
        "registered, --production-n of them built per case")  # fmt: skip
    add("--production-n", type=int, default=256, help="partitions each case builds")
    add("--production-sleep", type=float, default=0.0, help="seconds of work per partition")
    add("--production-per-run", type=int, default=256, help="partitions per tuned run")
    add("--scan-cpu-s", type=float, default=3.0,
        help="CPU seconds of one full-size scan, for the fleet break-even")  # fmt: skip


def main(work: Path, args: argparse.Namespace) -> None:
    production(work, args.production_n, args.production_sleep, args.scan_cpu_s,
               args.production_per_run)  # fmt: skip
