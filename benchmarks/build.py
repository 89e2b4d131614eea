"""Build benchmarks: a CT backfill of 16 scans (raw ingest included, batched runs) vs a naive
per-scan preprocessing script over the same scans, with Dagster's share per partition and
the runs it created; the whole CT branch per scan vs the naive script and vs
the same Dagster run with empty asset bodies (the part no body can save), Dagster's
per-partition overhead with one run per partition vs batched runs and on a SQLite
vs a Postgres instance, and the production shape: an 8-partition CT backfill of full-size
scans through the daemon and a Postgres instance with steps on 2 Celery workers vs the
multiprocess executor (deploy/README.md), its wall time, runs, and the share of that time
during which no step was building partitions (read from the instance's event log).

    python benchmarks/build.py            # a 512×512×300 CT-RATE-class scan, 100 partitions
    python benchmarks/build.py --quick    # small inputs, 4-scan backfill, no production shape (CI)
    python benchmarks/build.py --only-backfill --backfill-scans 8   # the CT backfill only
    python benchmarks/build.py --only-production   # the production-shape backfill only

The Postgres and Celery figures need Postgres and Redis on 127.0.0.1 (tests/services.py
says how to start them) and their Python clients; where they are missing, those figures are
skipped with a line that says why, and the others are still measured.
"""

import argparse
import functools
import importlib.util
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import yaml
from _bench import bench, ratio, touch_memory

from zarrfeed.assets import build as build_module
from zarrfeed.assets import family_assets
from zarrfeed.assets.build import BATCH, Built, materialize_partitions
from zarrfeed.assets.metadata import partition_metadata
from zarrfeed.families.ct import CT
from zarrfeed.families.ct.tables import read_ct_rate_metadata
from zarrfeed.jobs.discovery import discover_into
from zarrfeed.resources import (
    BuildOptions,
    HuggingFaceResource,
    RawFolderResource,
    ZarrStoreResource,
)
from zarrfeed.samples import make_ct_rate
from zarrfeed.transforms import ct
from zarrfeed.transforms.hu import csv_rescale

# The deployment helpers the tests use: one way to start the production shape.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ct_builds import ct_deployment, ct_raw
from services import (
    PG_PORT,
    REDIS_PORT,
    REPO,
    ServiceDown,
    instance_yaml,
    postgres_database,
    redis_database,
    require,
)

warnings.filterwarnings("ignore", category=dg.BetaWarning)


def naive_ct_branch(path: Path, slope: float, intercept: float, out: Path) -> None:
    """The whole CT branch for one scan as a plain single-process preprocessing script
    writes it: float64 numpy, ``scipy.ndimage.zoom``, per-window float64 arithmetic,
    ``np.argwhere`` for occupancy, a Python loop for the patch filter, uncompressed .npy."""
    import nibabel as nib
    from scipy.ndimage import zoom

    img = nib.load(path)
    vol = np.asarray(img.dataobj).astype(np.float64).transpose(2, 1, 0)  # (z, y, x)
    if vol.min() > -500:
        vol = vol * slope + intercept
    sx, sy, sz = img.header.get_zooms()[:3]
    factors = [s / t for s, t in zip((sz, sy, sx), (1.5, 0.75, 0.75), strict=True)]
    hu = np.clip(zoom(vol, factors, order=1), -1024, 3071)
    np.save(out / "hu.npy", np.rint(hu).astype(np.int16))
    for name in ("lung", "mediastinum", "bone"):
        w = ct.get_window(name)
        win = np.clip((hu - w.lo) / (w.hi - w.lo), 0, 1)
        np.save(out / f"{name}.npy", win.astype(np.float16))
        cells = np.argwhere(win > 0.5) * 64 // np.array(win.shape)  # TRELLIS 64³ occupancy:
        grid = np.zeros((64, 64, 64), dtype=bool)  # ss[coords] = 1, then the occupied cells
        grid[tuple(cells.T)] = True
        np.save(out / f"{name}_sparse.npy", np.argwhere(grid).astype(np.uint16))
    body, keep = hu > -500, []
    for z in range(0, hu.shape[0] - 63, 64):
        for y in range(0, hu.shape[1] - 63, 64):
            for x in range(0, hu.shape[2] - 63, 64):
                if body[z : z + 64, y : y + 64, x : x + 64].mean() >= 0.25:
                    keep.append((z, y, x))
    np.save(out / "patches.npy", np.array(keep, dtype=np.uint16))


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    t = os.times()
    return t.user + t.system


def hollow(assets: dg.AssetsDefinition) -> dg.AssetsDefinition:
    """The same assets and blocking checks with an empty body: one step that records what
    the real one records, so a run of hollow twins costs what Dagster costs around the work."""
    checks = list(assets.check_specs)

    @dg.multi_asset(
        name=assets.node_def.name,
        specs=[s.replace_attributes(partitions_def=None) for s in assets.specs],
        check_specs=checks,
        partitions_def=assets.partitions_def,
        can_subset=True,
    )
    def twin(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult]:
        for key in context.selected_asset_keys:
            passed = [dg.AssetCheckResult(asset_key=key, check_name=c.name, passed=True)
                      for c in checks if c.asset_key == key]  # fmt: skip
            yield dg.MaterializeResult(asset_key=key, check_results=passed)

    return twin


def build_ct_scan(
    work: Path, raw: Path, key: str, empty: bool = False
) -> tuple[float, float, int, float]:
    """One scan through the whole CT branch in a fresh instance and store: the run's wall
    time, its asset bodies' time, the bytes it stored and the CPU time it took.  With
    ``empty`` the graph's hollow twins run instead (nothing is built or stored)."""
    resources = {
        "build": BuildOptions(),
        "hf": HuggingFaceResource(),
        "zarr_store": ZarrStoreResource(url=str(work / "store.zarr")),
        "raw": RawFolderResource(root=str(raw)),
    }
    (work / "home").mkdir(parents=True)
    with dg.instance_for_test(temp_dir=str(work / "home")) as instance:
        assert discover_into(instance, CT, resources["raw"], resources["zarr_store"]) == [key]
        assets = family_assets(CT, {})  # the defaults: CT-CLIP spacing, 3 windows, 64³ occupancy
        if empty:
            assets = [hollow(a) for a in assets]
        cpu, t0 = cpu_seconds(), time.perf_counter()
        result = dg.materialize(assets, partition_key=key, resources=resources, instance=instance)
        ours, cpu = time.perf_counter() - t0, cpu_seconds() - cpu
    if empty:
        return ours, 0.0, 0, cpu
    body = sum(m.metadata["seconds"].value for m in result.get_asset_materialization_events()
               for m in [m.materialization] if "seconds" in m.metadata)  # fmt: skip
    assert result.success and all(c.passed for c in result.get_asset_check_evaluations())
    store = resources["zarr_store"].store()
    stored = sum(store.commit_record(a, key)["stored_bytes"]
                 for a in ("ct/hu", "ct/windows", "ct/sparse", "ct/patches"))  # fmt: skip
    return ours, body, stored, cpu


def ct_branch(work: Path, size: str, rounds: int = 2) -> None:
    """Each side runs ``rounds`` times from scratch, alternating, and keeps its fastest run
    (like every other figure here), on memory the VM has already backed (``touch_memory``)."""
    raw = work / "raw"
    path = next(make_ct_rate(raw / "ct-rate", 1, size, np.random.default_rng(0)))
    key = path.name.removesuffix(".nii.gz")
    claim = csv_rescale(read_ct_rate_metadata(raw).get(key))
    slope, intercept = (claim.slope, claim.intercept) if claim else (1.0, 0.0)
    touch_memory(6.0 if size == "full" else 1.0)  # above either side's peak (naive: 4 GB)
    runs, naive, fixed = [], [], []
    for i in range(rounds):
        runs.append(build_ct_scan(work / f"ours{i}", raw, key))
        fixed.append(build_ct_scan(work / f"empty{i}", raw, key, empty=True))
        (work / f"naive{i}").mkdir()
        t0 = time.perf_counter()
        naive_ct_branch(path, slope, intercept, work / f"naive{i}")
        naive.append(time.perf_counter() - t0)
    ours, _, stored, cpu = min(runs)
    base = min(naive)
    npy = sum(p.stat().st_size for p in (work / "naive0").iterdir())
    shape = CT_SHAPES[size]
    text = (f"{shape} scan, HU + 3 windows + sparse + patch index, incl. Dagster run and checks; "
            f"best of {rounds} (zarrfeed {' '.join(f'{r[0]:.2f}' for r in runs)} s, "
            f"naive {' '.join(f'{t:.1f}' for t in naive)} s)")  # fmt: skip
    ratio("build.ct_scan_vs_naive", ours, base, text)
    bench("build.ct_scan_seconds", ours, "s", f"{shape} scan, whole CT branch, 1 run")
    cores = len(os.sched_getaffinity(0))
    bench("build.ct_scan_cpu_s", cpu, "s", f"user + system CPU of that run, {cores} cores")
    hollow_s, *_, hollow_cpu = min(fixed)
    bench("build.ct_dagster_fixed_s", hollow_s, "s",
          f"the same run with empty asset bodies (same assets, steps and blocking checks; "
          f"{hollow_cpu:.2f} s CPU): Dagster's share, which no body can save")  # fmt: skip
    ratio("build.ct_scan_compute_vs_naive", min(r[1] for r in runs), base,
          "asset-body compute + write only (no checks, no Dagster run)")  # fmt: skip
    bench(
        "build.ct_disk_ratio",
        npy / stored,
        "x",
        f"naive .npy {npy / 1e6:.0f} MB / store {stored / 1e6:.0f} MB",
    )


CT_SHAPES = {"small": "40x96x96", "full": "300x512x512"}
BODY_SECONDS: list[float] = []


@dg.asset(
    partitions_def=dg.DynamicPartitionsDefinition(name="bench"),
    code_version="1",
    check_specs=[dg.AssetCheckSpec("non_empty", asset="bench_tiny", blocking=True)],
)
def bench_tiny(
    context: dg.AssetExecutionContext, zarr_store: ZarrStoreResource
) -> Iterator[dg.MaterializeResult]:
    """A small partition written through the store: what Dagster costs around it."""
    store = zarr_store.store()
    asset = dg.AssetKey("bench_tiny")

    def one(key: str) -> Iterator[tuple[dg.AssetKey, Built]]:
        t0 = time.perf_counter()
        with store.write_partition("bench/tiny", key, {"fingerprint": key}) as w:
            w.write("a", np.full((64, 64), len(key), np.uint8), read="whole")
        seconds = time.perf_counter() - t0
        BODY_SECONDS.append(seconds)
        metadata = partition_metadata(store, "bench/tiny", key, seconds, "benchmark")
        yield asset, Built(metadata, {"non_empty": (True, {})}, key)

    yield from materialize_partitions(context, [asset], one, lambda: 1 << 20)


def overhead(instance: dg.DagsterInstance, keys: list[str], resources: dict, mode: str) -> float:
    """Run time minus asset-body time per partition: one run per partition (``single``) or
    16 partitions per run (``batched``, BackfillPolicy.multi_run(16) as the daemon splits it)."""
    BODY_SECONDS.clear()
    t0 = time.perf_counter()
    if mode == "single":
        for k in keys:
            dg.materialize([bench_tiny], partition_key=k, resources=resources, instance=instance)
    else:
        for i in range(0, len(keys), 16):
            batch = keys[i : i + 16]
            tags = {"dagster/asset_partition_range_start": batch[0],
                    "dagster/asset_partition_range_end": batch[-1]}  # fmt: skip
            dg.materialize([bench_tiny], tags=tags, resources=resources, instance=instance)
    return (time.perf_counter() - t0 - sum(BODY_SECONDS)) / len(keys)


def production_missing(modules: tuple[str, ...], services: dict[str, int]) -> str | None:
    """Why the production-shape figures cannot run here (a package not installed, a service
    not answering on 127.0.0.1), or None: those figures are skipped then, the others kept."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    for service, port in services.items():
        try:
            require(service, port)
        except ServiceDown as down:
            return str(down)
    return None


def dagster_overhead(work: Path, n: int) -> None:
    keys = [f"p{i:04d}" for i in range(n)]
    resources = {"zarr_store": ZarrStoreResource(url=str(work / "tiny.zarr"))}
    results = {}
    with dg.instance_for_test(temp_dir=str(work / "home2")) as instance:
        instance.add_dynamic_partitions("bench", keys)
        for mode in ("single", "batched"):
            results[mode] = overhead(instance, keys, resources, mode)
    text = f"per partition, {n} partitions, in-process runs: run time - asset body time"
    bench("build.dagster_overhead_s.single", results["single"], "s", f"{text}, SQLite instance")
    bench("build.dagster_overhead_s.batched", results["batched"], "s", f"{text}, SQLite instance")
    ratio("build.dagster_overhead_batched_vs_single", results["batched"], results["single"],
          "16 partitions per run")  # fmt: skip
    missing = production_missing(("psycopg2", "dagster_postgres"), {"PostgreSQL": PG_PORT})
    if missing:
        print(f"# build.dagster_overhead_s.postgres skipped: {missing}", flush=True)
        return
    # The production instance's storage (deploy/dagster.yaml) on a fresh database.
    storage = yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())["storage"]
    with postgres_database() as pg:
        os.environ.update(pg)
        (work / "home3").mkdir()
        with dg.instance_for_test(
            temp_dir=str(work / "home3"), overrides={"storage": storage}
        ) as instance:
            instance.add_dynamic_partitions("bench", keys)
            results["postgres"] = overhead(instance, keys, resources, "single")
    bench("build.dagster_overhead_s.postgres", results["postgres"], "s",
          f"{text}, one run per partition, Postgres instance (dagster-postgres)")  # fmt: skip
    ratio("build.dagster_overhead_postgres_vs_sqlite", results["postgres"], results["single"],
          "one run per partition: SQLite time / Postgres time")  # fmt: skip


# What a batched step logs once its partitions are built and recorded (materialize_partitions):
# the log record's timestamp minus its seconds is when the build started.
BUILT = re.compile(r"built (\d+) of (\d+) partitions, \d+ at once, in ([\d.]+) s")


@dataclass
class Backfill:
    """A backfill as its instance recorded it: wall time from launch to the last run's end,
    and when each step of its runs was building partitions (from the steps' build lines)."""

    wall: float
    runs: int
    steps: int
    partitions: int  # partitions built, summed over the steps
    build: float  # seconds the steps spent building, summed over the steps
    building: float  # seconds during which at least one step was building (the union)
    timeline: list[str]  # when each run and step reached each phase, one line each
    phases: dict[str, float]  # seconds outside the builds, by phase, summed over runs and steps


# Where a backfill's wall time outside the builds goes (Backfill.phases), in order.
PHASES = (
    "backfill daemon tick",  # launch to the first run created (the daemon loops every 30 s)
    "run creation",  # created (its planned events written) to enqueued
    "run queue",  # enqueued to dequeued by the run coordinator
    "run process start",  # dequeued to the run's process executing it
    "executor (before each step, after the last)",
    "step dispatch (submitted to step start)",  # Celery queue, worker or subprocess start
    "step set-up (step start to building)",
    "step finish (building to step success)",  # last partition's events, step outputs
)


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` ((start, end) pairs)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kind(entry: dg.EventLogEntry) -> str:
    """The entry's Dagster event type (``STEP_START``...), ``LOG`` for a log message."""
    return entry.dagster_event.event_type_value if entry.dagster_event else "LOG"


def recorded_backfill(instance: dg.DagsterInstance, backfill: str, launched: float) -> Backfill:
    """The backfill ``backfill`` (launched at ``launched``, epoch seconds) from the run storage
    and the event log.  A step builds from its build line's start to the first event of the
    last partition it recorded.  A successful step that logged no build line fails the
    measure (a one-partition run logs none: its building would count as orchestration)."""
    records = instance.get_run_records(filters=dg.RunsFilter(tags={"dagster/backfill": backfill}))
    intervals, partitions, timeline = [], 0, []
    phases = dict.fromkeys(PHASES, 0.0)
    first_run = min(r.create_timestamp for r in records).timestamp()
    phases["backfill daemon tick"] = first_run - launched

    def at(t: float) -> str:
        return f"{t - launched:.1f}"

    for record in sorted(records, key=lambda r: r.create_timestamp):
        run = record.dagster_run.run_id
        # The events of the run as it ran (the planned ones are written when it is created).
        events = [e for e in instance.all_logs(run) if not kind(e).endswith("_PLANNED")]
        first: dict[tuple[str | None, str], float] = {}
        for e in events:
            first.setdefault((e.step_key, kind(e)), e.timestamp)
        starts = {step: t for (step, what), t in first.items() if what == "STEP_START"}
        created = record.create_timestamp.timestamp()
        run_start = first[None, "PIPELINE_START"]
        phases["run creation"] += first[None, "PIPELINE_ENQUEUED"] - created
        phases["run queue"] += first[None, "PIPELINE_STARTING"] - first[None, "PIPELINE_ENQUEUED"]
        phases["run process start"] += run_start - first[None, "PIPELINE_STARTING"]
        previous = run_start  # the executor hands out the next step after this
        timeline.append(
            f"run {run[:8]}: created by the daemon {at(created)}, "
            f"enqueued {at(first[None, 'PIPELINE_ENQUEUED'])}, dequeued "
            f"{at(first[None, 'PIPELINE_STARTING'])}, run process started "
            f"{at(first[None, 'PIPELINE_START'])}, run success {at(record.end_time)}"
        )
        for step in sorted(starts, key=starts.get):
            if (step, "STEP_SUCCESS") not in first:
                raise AssertionError(f"run {run}: step {step} did not succeed")
            mine = [e for e in events if e.step_key == step]
            lines = [(e.timestamp, m) for e in mine if (m := BUILT.search(e.user_message or ""))]
            if len(lines) != 1:
                raise AssertionError(
                    f"run {run}: step {step} logged {len(lines)} lines 'built N of M "
                    f"partitions, K at once, in T s', expected 1"
                )
            logged, match = lines[0]
            built, seconds = int(match[1]), float(match[3])
            start = logged - seconds
            # The line follows the recording of the last partition built: its build ended
            # when its first materialisation was written.
            done = [e for e in mine if kind(e) == "ASSET_MATERIALIZATION" and e.timestamp <= logged]
            last = done[-1].dagster_event.partition
            end = min(e.timestamp for e in done if e.dagster_event.partition == last)
            intervals.append((start, end))
            partitions += built
            submitted = min(t for (k, _), t in first.items() if k == step)
            success = first[step, "STEP_SUCCESS"]
            phases["executor (before each step, after the last)"] += max(0, submitted - previous)
            phases["step dispatch (submitted to step start)"] += starts[step] - submitted
            phases["step set-up (step start to building)"] += start - starts[step]
            phases["step finish (building to step success)"] += success - end
            previous = max(previous, success)
            timeline.append(
                f"  {step}: submitted {at(submitted)}, step start {at(starts[step])}, building "
                f"{at(start)}-{at(end)} ({built} partitions), step success "
                f"{at(success)}"
            )
        phases["executor (before each step, after the last)"] += record.end_time - previous
    return Backfill(
        wall=max(r.end_time for r in records) - launched,
        runs=len(records),
        steps=len(intervals),
        partitions=partitions,
        build=sum(e - s for s, e in intervals),
        building=union_seconds(intervals),
        timeline=timeline,
        phases=phases,
    )


def backfill(work: Path, raw: Path, executor: str) -> Backfill:
    """An 8-partition CT backfill (default CT settings) launched like the UI does and run by
    the daemon on a fresh Postgres instance with deploy/dagster.yaml's limits: steps on 2
    Celery workers, or in subprocesses of each run (multiprocess executor)."""
    workers = ("w1", "w2") if executor == "celery" else ()
    production = yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())
    with postgres_database() as pg, redis_database() as broker:
        env = {**pg, **broker, "ZARRFEED_EXECUTOR": executor}
        folder = work / executor
        default_settings = ("-m", "zarrfeed.definitions")
        with ct_deployment(
            folder, raw, instance_yaml(production), env, workers, default_settings
        ) as (d, keys):
            d.set_pool_limit("zarrfeed_io", 8)
            launched = time.time()
            expected = -(-len(keys) // BATCH.max_partitions_per_run)  # batched: runs over ranges
            backfill_id = d.launch_backfill("ct_build", keys)
            runs = d.wait_backfill(backfill_id, expected)
            assert all(r.is_success for r in runs), [r.status for r in runs]
            with d.instance() as instance:
                return recorded_backfill(instance, backfill_id, launched)


def backfills(work: Path) -> None:
    """The production shape (daemon, Postgres, Celery workers; then the multiprocess
    executor) on 8 full-size scans: wall time, runs, and the share of the wall time during
    which no step was building partitions, with where that time went as ``#`` lines."""
    missing = production_missing(
        ("psycopg2", "dagster_postgres", "redis", "celery", "dagster_celery"),
        {"PostgreSQL": PG_PORT, "Redis": REDIS_PORT},
    )
    if missing:
        print(f"# build.backfill_* skipped: {missing}", flush=True)
        return
    raw = ct_raw(work / "raw8", 8, "full")
    found = {}
    for executor, how in (("celery", "steps on 2 Celery workers"),
                          ("multiprocess", "multiprocess executor")):  # fmt: skip
        b = found[executor] = backfill(work, raw, executor)
        for line in b.timeline:
            print(f"# {executor} (s since launch) {line}", flush=True)
        print(f"# {executor} outside the builds (s): "
              + ", ".join(f"{p} {s:.1f}" for p, s in b.phases.items()), flush=True)  # fmt: skip
        text = f"8 CT partitions ({CT_SHAPES['full']} scans), daemon + Postgres, {how}"
        bench(f"build.backfill_8_s.{executor}", b.wall, "s", f"{text}: launch to last run end")
        bench(f"build.backfill_orchestration_share.{executor}", 1 - b.building / b.wall, "share",
              f"{text}: share of the wall time with no step building partitions; wall "
              f"{b.wall:.1f} s ({b.phases['backfill daemon tick']:.1f} s before a run existed), "
              f"{b.runs} run(s), {b.steps} steps, {b.partitions} partition builds, "
              f"{b.building:.1f} s with a step building ({b.build:.1f} s summed)")  # fmt: skip
    bench("build.backfill_runs", found["celery"].runs, "runs",
          f"runs the 8-partition backfill created (multiprocess executor: "
          f"{found['multiprocess'].runs})")  # fmt: skip
    ratio("build.backfill_celery_vs_multiprocess", found["celery"].wall,
          found["multiprocess"].wall, "8-partition backfill: multiprocess / Celery")  # fmt: skip


BUILDING: list[float] = []  # wall seconds each batched step spent building its partitions
RECORDING: list[float] = []  # wall seconds each partition's events took to write


def timed(real: Callable, into: list[float]) -> Callable:
    """``real``, the wall time of each call appended to ``into``."""

    @functools.wraps(real)
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return call


def ct_backfill(work: Path, size: str, n: int) -> None:
    """``n`` scans through the whole CT branch, raw ingest included, as a backfill runs them:
    runs of the assets' backfill policy (``BackfillPolicy.multi_run``) over partition ranges,
    in process on a fresh SQLite instance, vs the naive script over the same scans one after
    another.  Dagster's share per partition: run wall time minus the time its steps spent
    building partitions (everything around the work: runs, steps, events, checks; the
    events of partitions that commit while others build are written beside the work)."""
    raw = work / f"raw{n}"
    paths = list(make_ct_rate(raw / "ct-rate", n, size, np.random.default_rng(1)))
    rows = read_ct_rate_metadata(raw)
    resources = {
        "build": BuildOptions(),
        "hf": HuggingFaceResource(),
        "zarr_store": ZarrStoreResource(url=str(work / "backfill.zarr")),
        "raw": RawFolderResource(root=str(raw)),
    }
    (work / "home_backfill").mkdir()
    BUILDING.clear()
    RECORDING.clear()
    build_module.build_range = timed(build_module.build_range, BUILDING)
    recorder = build_module.PartitionRecorder
    recorder.record = timed(recorder.record, RECORDING)
    with dg.instance_for_test(temp_dir=str(work / "home_backfill")) as instance:
        keys = discover_into(instance, CT, resources["raw"], resources["zarr_store"])
        assert len(keys) == n
        assets = family_assets(CT, {})  # the defaults, as in build.ct_scan_vs_naive
        per_run = BATCH.max_partitions_per_run or 1
        t0 = time.perf_counter()
        for i in range(0, n, per_run):
            batch = keys[i : i + per_run]
            tags = {"dagster/asset_partition_range_start": batch[0],
                    "dagster/asset_partition_range_end": batch[-1]}  # fmt: skip
            result = dg.materialize(assets, tags=tags, resources=resources, instance=instance)
            assert result.success
        ours = time.perf_counter() - t0
        runs = instance.get_runs_count()
    build_module.build_range = build_module.build_range.__wrapped__
    recorder.record = recorder.record.__wrapped__
    naive = work / "naive_backfill"
    t0 = time.perf_counter()
    for path in paths:
        key = path.name.removesuffix(".nii.gz")
        claim = csv_rescale(rows.get(key))
        slope, intercept = (claim.slope, claim.intercept) if claim else (1.0, 0.0)
        (naive / key).mkdir(parents=True)
        naive_ct_branch(path, slope, intercept, naive / key)
    base = time.perf_counter() - t0
    cores = len(os.sched_getaffinity(0))
    text = (f"{n} {CT_SHAPES[size]} scans, raw ingest -> HU, windows, sparse, patch index, "
            f"{runs} Dagster run(s) of up to {per_run} partitions ({ours:.1f} s) vs the naive "
            f"script per scan ({base:.1f} s), {cores} cores")  # fmt: skip
    ratio("build.ct_backfill_vs_naive", ours, base, text)
    bench("build.ct_backfill_runs", runs, "runs", f"runs created for {n} scans")
    outside = (ours - sum(BUILDING)) / n
    # A step records each partition (materialisations, checks) as it commits, while the
    # others build: those writes are inside the builds' wall time, and said here.
    bench("build.dagster_overhead_per_partition_s", outside, "s",
          f"that backfill's wall time outside its steps' partition builds, each "
          f"({sum(RECORDING):.1f} s of partition event writes ran beside the builds)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small inputs (smoke run)")
    parser.add_argument("--backfill-scans", type=int, default=16,
                        help="scans in the CT backfill figure")  # fmt: skip
    parser.add_argument("--only-backfill", action="store_true",
                        help="measure the CT backfill figures only")  # fmt: skip
    parser.add_argument("--only-production", action="store_true",
                        help="measure the production-shape backfill figures only")  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "home2").mkdir()
        if args.only_production:
            backfills(work)
            return
        size = "small" if args.quick else "full"
        ct_backfill(work, size, 4 if args.quick else args.backfill_scans)
        if args.only_backfill:
            return
        ct_branch(work, size, rounds=1 if args.quick else 2)
        dagster_overhead(work, 20 if args.quick else 100)
        if not args.quick:  # two deployments: minutes, not a smoke run
            backfills(work)


if __name__ == "__main__":
    main()
