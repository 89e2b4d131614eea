"""The code location the production-shape benchmark serves: CT's shape with the work replaced.

Five partitioned assets in three steps, as the CT family builds a scan (raw ingest alone, then
two multi-asset steps of two stored assets each), every stored asset with a blocking check
partitioned like it, over one dynamic partition set.  Each step records its partitions with
zarrfeed's own batched-step machinery (``materialize_partitions``: one materialisation and one
check evaluation per partition and asset), so the event writes are the production ones; only
the build is a sleep of ``ZARRFEED_BENCH_SLEEP`` seconds (0: none).  Read when the location
loads:

- ``ZARRFEED_BENCH_PER_RUN``: comma-separated partitions per run; each size is a copy of the
  five assets (group ``p<size>``, backfill policy ``multi_run(size)``), its asset job
  ``bench_p<size>`` and its sensor ``bench_sensor_p<size>``, which requests ranges of that
  size as the discovery sensor does;
- ``ZARRFEED_BENCH_FAIL``: partition keys whose build raises (a failed partition of a batch);
- ``ZARRFEED_EXECUTOR``: ``celery`` or ``multiprocess``, as the project's deployment component.
"""

import os
import time
from collections.abc import Iterator

import dagster as dg

from zarrfeed.assets.build import IO_POOL, Built, intended, materialize_partitions
from zarrfeed.components.deployment import executor
from zarrfeed.jobs.queue import PER_TICK
from zarrfeed.jobs.requests import batched_requests

SCANS = dg.DynamicPartitionsDefinition(name="bench_scans")
STEPS = {"raw": ["raw_scan"], "volumes": ["hu", "windows"], "index": ["sparse", "patches"]}
UPSTREAM = {"volumes": "raw_scan", "index": "windows"}
CHECK = "finite_values"


def settings() -> tuple[list[int], float, set[str]]:
    """(partitions per run of each copy, seconds of work per partition, partitions that
    fail) from the environment."""
    sizes = [int(s) for s in os.environ.get("ZARRFEED_BENCH_PER_RUN", "16").split(",") if s]
    fail = {k for k in os.environ.get("ZARRFEED_BENCH_FAIL", "").split(",") if k}
    return sizes, float(os.environ.get("ZARRFEED_BENCH_SLEEP", "0")), fail


def step_asset(size: int, step: str, sleep: float, fail: set[str]) -> dg.AssetsDefinition:
    """One step of copy ``p<size>``: its assets, each partition a sleep, recorded per
    partition."""
    prefix = f"p{size}_"
    names = STEPS[step]
    deps = [prefix + UPSTREAM[step]] if step in UPSTREAM else []
    with intended():
        specs = [
            dg.AssetSpec(prefix + n, deps=deps, group_name=f"p{size}", tags={"stage": "stored"})
            for n in names
        ]
        checks = [
            dg.AssetCheckSpec(CHECK, asset=prefix + n, blocking=True, partitions_def=SCANS)
            for n in names
        ]

        @dg.multi_asset(
            name=f"{prefix}{step}",
            specs=specs,
            check_specs=checks,
            partitions_def=SCANS,
            backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=size),
            can_subset=True,
            pool=IO_POOL if step == "raw" else None,
        )
        def _step(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult]:
            def build(key: str) -> Iterator[tuple[dg.AssetKey, Built]]:
                if key in fail:
                    raise ValueError(f"{key}: fails on purpose (ZARRFEED_BENCH_FAIL)")
                time.sleep(sleep)
                for spec in specs:
                    checks = {CHECK: (True, {"n_nan": 0})}
                    yield spec.key, Built({"partition": key}, checks, data_version=key)

            keys = [s.key for s in specs if s.key in context.selected_asset_keys]
            yield from materialize_partitions(context, keys, build, lambda: 1 << 20)

    return _step


def bench_sensor(size: int, job: str) -> dg.SensorDefinition:
    """Runs of ``job`` over the registered partitions ``next`` to ``stop`` (by position; the
    cursor ``next:stop``, set before the sensor starts), in ranges of ``size`` made as the
    discovery sensor makes them, at most its PER_TICK runs a tick."""

    @dg.sensor(
        name=f"bench_sensor_p{size}",
        job_name=job,
        minimum_interval_seconds=5,
        default_status=dg.DefaultSensorStatus.STOPPED,
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        start, _, stop = (context.cursor or "0:0").partition(":")
        keys = context.instance.get_dynamic_partitions(SCANS.name)[int(start) : int(stop)]
        if not keys:
            return dg.SkipReason(f"every partition before position {stop} requested")
        runs = [keys[i : i + size] for i in range(0, len(keys), size)][:PER_TICK]
        requested = [[(k, "benchmark") for k in run] for run in runs]
        requests = batched_requests(job, "bench", requested, lambda k: "")
        return dg.SensorResult(
            run_requests=requests, cursor=f"{int(start) + sum(map(len, runs))}:{stop}"
        )

    return _sensor


def definitions() -> dg.Definitions:
    sizes, sleep, fail = settings()
    assets, jobs, sensors = [], [], []
    for size in sizes:
        assets += [step_asset(size, step, sleep, fail) for step in STEPS]
        job = dg.define_asset_job(
            f"bench_p{size}", selection=dg.AssetSelection.groups(f"p{size}"), partitions_def=SCANS
        )
        jobs.append(job)
        sensors.append(bench_sensor(size, job.name))
    return dg.Definitions(
        assets=assets,
        jobs=jobs,
        sensors=sensors,
        executor=executor(os.environ.get("ZARRFEED_EXECUTOR", "multiprocess")),
    )


defs = definitions()
