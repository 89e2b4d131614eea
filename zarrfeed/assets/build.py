"""How every stored asset's partitions are built: one routine, driven by the data contract.

A family's builder supplies a :class:`~zarrfeed.families.Step` per partition — its
fingerprint inputs, how to produce its arrays, how to check them — and
:func:`build_partition` does the rest the same way for all:

1. the fingerprint from the contract (code version, declared settings, inputs: the raw
   item, or the upstream partitions' fingerprints and content digests);
2. reuse when the committed partition has that fingerprint and its stored data still reads,
   matches its recorded checksums and passes the checks (stored data that does not is
   rebuilt: corruption heals itself);
3. otherwise produce, conform to the contract (names, dtypes, dims), check **before
   committing**, and commit the arrays with their provenance and check results — a
   partition that fails a blocking check is committed for inspection but never enters a
   dataset (``store.contract.failed_checks``);
4. the metadata and check results Dagster records.

:func:`materialize_partitions` runs it for the run's partition or for the partitions of a
batched backfill run, several at once; :func:`stored_asset` and :func:`stored_multi_asset`
declare the Dagster assets from the contract.
"""

import os
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import numpy as np

from zarrfeed.assets.events import PartitionRecorder, logged
from zarrfeed.assets.metadata import partition_metadata, readable, shown
from zarrfeed.batching import in_flight, per_run, worker_processes
from zarrfeed.errors import StoreError, ZarrfeedError
from zarrfeed.families.stages import Checks, Step
from zarrfeed.jobs.liveness import orchestrating_pid, runs_in_process
from zarrfeed.processes import available_memory, usable_cpus
from zarrfeed.store import ZarrStore, provenance
from zarrfeed.store.checksums import ATTR, array_checksum, recorded_checksums
from zarrfeed.store.contract import CONTENT, UPSTREAM, StoredAsset, content_digest, stale_reason
from zarrfeed.workerpool import run_in_processes, start_problem, warm_up

# Backfills run this many partitions per run, raw ingest included (every partitioned asset
# of a family has this policy, so a family's backfill runs all its steps in one run per
# batch): the ~1–2 s start-up of a run is paid once per batch (benchmarks/build.py).
BATCH = dg.BackfillPolicy.multi_run(max_partitions_per_run=per_run(usable_cpus()))
OWNERS = ["team:ml-data"]
IO_POOL = "zarrfeed_io"  # raw ingest and downloads (deploy/dagster.yaml sets its limit)


@contextmanager
def intended() -> Iterator[None]:
    """Dagster 1.13 features used on purpose, their warnings silenced where they are used
    (never process-wide): ``backfill_policy=`` (beta; the documented way to batch) and
    checks partitioned like their asset (preview; the UI shows each partition's result and
    plots each partition's history apart)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*backfill_policy", dg.BetaWarning)
        warnings.filterwarnings(
            "ignore", ".*partitions_def on an AssetCheckSpec", dg.PreviewWarning
        )
        yield


@dataclass
class Built:
    """What building (or reusing) one partition reports.  A stored partition's data version
    is its committed version: reuse keeps it, and any new commit changes it — also a forced
    or healing rebuild with an unchanged fingerprint, which replaces the version a dataset
    manifest pins, so the manifest's automation must see it."""

    metadata: dict[str, Any]
    checks: Checks = field(default_factory=dict)
    data_version: str | None = None


def stored_arrays(store: ZarrStore, spec: StoredAsset, key: str) -> dict[str, np.ndarray]:
    names = sorted(store.commit_record(spec.path, key)["arrays"])
    return {name: store.read_array(spec.path, key, name) for name in names}


def changed_arrays(record: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> list[str]:
    """The arrays whose stored values differ from the checksums their commit recorded (a
    lost chunk file reads as fill values, which may well pass the checks); arrays without a
    recorded checksum are taken as they are."""
    sums, checksum = recorded_checksums(record.get("attrs") or {})
    return [n for n, d in arrays.items() if n in sums and checksum(d) != sums[n]]


def conform_checks(spec: StoredAsset, checks: Checks) -> Checks:
    """Refuse check results that are not the declared checks (a bug, never a bad input)."""
    if sorted(checks) != sorted(spec.check_names):
        raise ValueError(f"{spec.name}: checked {sorted(checks)}, contract says {spec.check_names}")
    return checks


def conform(spec: StoredAsset, settings: Mapping[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Refuse arrays that break the contract (a bug, never a bad input)."""
    want = spec.array_names(settings)
    if sorted(arrays) != sorted(want):
        raise ValueError(f"{spec.name}: produced arrays {sorted(arrays)}, contract says {want}")
    for name, data in arrays.items():
        a = spec.array(name)
        allowed = (a.dtype,) if isinstance(a.dtype, str) else a.dtype
        if data.dtype.name not in allowed or data.ndim != len(a.dims):
            raise ValueError(
                f"{spec.name}.{name}: produced {data.dtype} with {data.ndim} dims, contract "
                f"says {allowed} {a.dims}"
            )


def build_partition(
    store: ZarrStore,
    spec: StoredAsset,
    key: str,
    settings: Mapping[str, Any],
    force: bool,
    step: Step,
) -> Built:
    fingerprint = spec.fingerprint(settings, key, step.inputs)
    record = store.commit_record(spec.path, key) if store.has_partition(spec.path, key) else None
    stale = stale_reason(record, fingerprint)
    why = "forced" if force else None
    if why is None and stale is None:
        try:
            arrays = stored_arrays(store, spec, key)
        except StoreError as exc:  # a chunk that no longer decodes: rebuilt like the rest
            why, arrays = f"stored data does not read: {exc}", {}
    if why is None and stale is None:
        checks = conform_checks(spec, step.check(arrays))
        recorded = (record or {}).get("checks") or {}
        if any(ok != recorded.get(n, True) for n, (ok, _) in checks.items()):
            why = "stored data failed its checks"
        elif changed_arrays(record or {}, arrays):
            why = "stored data differs from its checksums"
        else:
            metadata = partition_metadata(store, spec.path, key, None, "unchanged inputs")
            return Built({**metadata, **described(step, arrays)}, checks, metadata["version"])
    why = why or ("first build" if record is None else stale)
    t0 = time.perf_counter()
    try:
        arrays = step.produce()
    except Exception:
        if step.watch is not None:
            step.watch.verify()  # a vanished or replaced file, named as such
        raise
    if step.watch is not None:
        step.watch.verify()
    conform(spec, settings, arrays)
    checks = conform_checks(spec, step.check(arrays))
    attrs = provenance(
        step.source,
        step.source_sha256,
        spec.version,
        spec.settings_of(settings, key),
        fingerprint=fingerprint,
        **({UPSTREAM: {u: step.inputs[u] for u in spec.upstream}} if spec.upstream else {}),
        **step.attrs,
    )
    attrs[ATTR] = {name: array_checksum(d) for name, d in arrays.items()}
    attrs[CONTENT] = content_digest(attrs[ATTR])  # what stages built from it fingerprint
    with store.write_partition(spec.path, key, attrs) as w:
        for name, data in arrays.items():
            a = spec.array(name)
            w.write(name, data, read=a.read, content=a.content, dimension_names=a.dims)
        w.checks = {n: ok for n, (ok, _) in checks.items()}
    seconds = time.perf_counter() - t0
    metadata = partition_metadata(store, spec.path, key, seconds, why)
    return Built({**metadata, **described(step, arrays)}, checks, metadata["version"])


def described(step: Step, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """What the builder reports about the partition, as the UI shows it."""
    return {name: shown(value) for name, value in step.describe(arrays).items()}


def check_specs(
    spec: StoredAsset, partitions_def: dg.PartitionsDefinition
) -> list[dg.AssetCheckSpec]:
    with intended():
        return [
            dg.AssetCheckSpec(
                c.name,
                asset=spec.name,
                blocking=True,
                description=c.description,
                partitions_def=partitions_def,
            )
            for c in spec.checks
        ]


def stored_asset(
    spec: StoredAsset,
    settings: Mapping[str, Any],
    partitions_def: dg.PartitionsDefinition,
    deps: list[str],
    resources: set[str],
) -> Callable:
    """``@dg.asset`` for a stored asset, everything taken from its declaration."""

    def wrap(fn: Callable) -> dg.AssetsDefinition:
        with intended():
            decorate = dg.asset(
                name=spec.name,
                required_resource_keys=resources,
                partitions_def=partitions_def,
                deps=deps,
                group_name=spec.family,
                code_version=spec.code_version(settings),
                description=spec.description,
                kinds=set(spec.kinds),
                owners=OWNERS,
                tags={"family": spec.family, "stage": "stored"},
                backfill_policy=BATCH,
                check_specs=check_specs(spec, partitions_def),
            )
        return decorate(fn)

    return wrap


def stored_multi_asset(
    name: str,
    specs: list[StoredAsset],
    settings: Mapping[str, Any],
    partitions_def: dg.PartitionsDefinition,
    deps: Mapping[str, list[str]],
    resources: set[str],
) -> Callable:
    """``@dg.multi_asset`` over several stored assets built in one step (any subset)."""

    def wrap(fn: Callable) -> dg.AssetsDefinition:
        with intended():
            decorate = dg.multi_asset(
                name=name,
                required_resource_keys=resources,
                specs=[
                    dg.AssetSpec(
                        s.name,
                        deps=deps[s.name],
                        group_name=s.family,
                        code_version=s.code_version(settings),
                        description=s.description,
                        kinds=set(s.kinds),
                        owners=OWNERS,
                        tags={"family": s.family, "stage": "stored"},
                    )
                    for s in specs
                ],
                check_specs=[c for s in specs for c in check_specs(s, partitions_def)],
                partitions_def=partitions_def,
                backfill_policy=BATCH,
                can_subset=True,
            )
        return decorate(fn)

    return wrap


PartitionBuild = Callable[[str], Iterator[tuple[dg.AssetKey, Built]]]


@dataclass(frozen=True)
class InProcesses:
    """How a step's partitions build in worker processes (``zarrfeed.workerpool``) instead
    of threads: ``task(job, key)`` returns what each asset built (by asset name) and why the
    partition failed, if it did; ``where(key)`` names a partition's source in an error."""

    task: Callable[[Any, str], tuple[list[tuple[str, Built]], str | None]]
    job: Any
    where: Callable[[str], str] = str


def in_processes(context: dg.AssetExecutionContext, item_bytes: int) -> bool:
    """Whether a batched step builds its partitions, needing ``item_bytes`` each, in worker
    processes (:func:`zarrfeed.batching.worker_processes`, where processes can start)."""
    if context.has_partition_key:
        return False
    keys = context.partition_keys
    workers = in_flight(usable_cpus(), available_memory(), item_bytes, len(keys))
    return worker_processes(workers, item_bytes) and start_problem() is None


def warm_workers(context: dg.AssetExecutionContext, item_bytes: int) -> None:
    """Start the worker processes' fork server now when the run's later steps will build
    items of ``item_bytes`` in them in this process: raw ingest, the first step of a batch,
    calls it, so that the server's imports (~2 s of CPU) run beside the hashing instead of
    before the first build.  Under the multiprocess or Celery executor each step has a
    process of its own, which starts its own server: warming one here would be wasted (the
    step runs in the run's own process exactly when that process orchestrates the run)."""
    here = orchestrating_pid(runs_in_process(context.run)) == os.getpid()
    if here and in_processes(context, item_bytes):
        warm_up()


def partition_error(exc: Exception) -> str:
    """Why a partition failed, as its step reports it: the message of an expected failure
    (a bad input, a store error), the traceback of a bug."""
    if isinstance(exc, (ZarrfeedError, dg.Failure, OSError, ValueError)):
        return str(exc)
    return "".join(traceback.format_exception(exc))


def materialize_partitions(
    context: dg.AssetExecutionContext,
    assets: list[dg.AssetKey],
    build: PartitionBuild,
    item_bytes: Callable[[], int],
    processes: InProcesses | None = None,
) -> Iterator[dg.MaterializeResult]:
    """Build the run's partitions of ``assets`` (``build(key)`` yields each asset's
    :class:`Built` in order) and report them.

    A one-partition run reports its results as Dagster does.  A batched run builds its
    partitions side by side, as many at once as the cores and the memory allow for items
    needing ``item_bytes()`` each (``zarrfeed.batching.in_flight``); each partition commits on
    its own, and a failing one fails alone: every partition that built is recorded as its
    own materialisation, data version and check results (``zarrfeed.assets.events``), and
    then the step fails naming the failed keys, so a retry (or a run of those keys) builds
    them while the committed ones are reused.  With ``processes``, a batch of large items
    builds in worker processes instead (``zarrfeed.batching.worker_processes``).
    """
    if context.has_partition_key:
        for asset, built in build(context.partition_key):
            yield dg.MaterializeResult(
                asset_key=asset,
                metadata=built.metadata,
                data_version=dg.DataVersion(built.data_version) if built.data_version else None,
                check_results=[
                    dg.AssetCheckResult(
                        asset_key=asset,
                        check_name=k.name,
                        passed=built.checks[k.name][0],
                        metadata=readable(built.checks[k.name][1]),
                    )
                    for k in context.selected_asset_check_keys
                    if k.asset_key == asset
                ],
            )
        return
    keys = list(context.partition_keys)
    size = item_bytes()
    workers = in_flight(usable_cpus(), available_memory(), size, len(keys))
    if processes is not None and not worker_processes(workers, size):
        processes = None
    if processes is not None and (problem := start_problem()):
        context.log.warning(f"building in threads, not worker processes: {problem}")
        processes = None
    recorder = PartitionRecorder(context, assets, keys)
    t0 = time.perf_counter()
    done: dict[str, dict[dg.AssetKey, Built]] = {}
    errors: dict[str, str] = {}
    recorded: set[str] = set()

    def record(key: str) -> None:
        """Partition ``key`` finished: recorded now, while the others build."""
        recorded.add(key)
        for asset, built in done[key].items():
            recorder.record(key, asset, built.metadata, built.data_version or "", built.checks)

    try:
        build_range(keys, build, workers, done, errors, record, processes)
    except BaseException:
        # Cancelled: the partitions not started never will be; those committed are recorded.
        context.log.warning(f"interrupted: {len(done)} of {len(keys)} partitions finished")
        for key in [k for k in done if k not in recorded]:
            record(key)
        yield from results(context, recorder)
        raise
    where = "worker processes" if processes else "threads"
    context.log.info(
        f"built {len(keys) - len(errors)} of {len(keys)} partitions, {workers} at once, in "
        f"{time.perf_counter() - t0:.1f} s ({where})"
    )
    yield from results(context, recorder)
    if errors:
        errors = {k: errors[k] for k in keys if k in errors}
        for key, error in errors.items():
            context.log.error(f"partition {key} failed: {error}")
        # Built partitions are committed and recorded; the failing ones are named so that a
        # retry (or a run of just those keys) builds them.
        raise dg.Failure(
            description=f"{len(errors)} of {len(keys)} partitions failed: "
            + "; ".join(f"{k}: {e}" for k, e in errors.items()),
            metadata={"failed": dg.MetadataValue.json(errors)},
        )


def results(
    context: dg.AssetExecutionContext, recorder: PartitionRecorder
) -> Iterator[dg.MaterializeResult]:
    """The step's result for each asset that has any partition recorded."""
    for asset, checks in recorder.checks.items():
        if checks:
            yield logged(context, asset, checks)


def build_range(
    keys: list[str],
    build: PartitionBuild,
    workers: int,
    done: dict[str, dict[dg.AssetKey, Built]],
    errors: dict[str, str],
    finished: Callable[[str], None] = lambda key: None,
    processes: InProcesses | None = None,
) -> None:
    """Build ``keys`` on ``workers`` threads (the transforms, codecs and hashes release the
    GIL) or, with ``processes``, on that many worker processes, filling ``done`` (what each
    finished partition built, by asset) and ``errors`` (why each failing one failed: a
    failure stops that partition only) as they finish, then calling ``finished(key)`` in the
    calling thread while the others build.  An interrupt (a cancelled run) cancels the
    partitions not yet started and is raised again, ``done`` holding those that finished."""
    if processes is not None:

        def ended(key: str, answer: Any, failure: str | None) -> None:
            built, error = answer if answer is not None else ([], failure)
            done[key] = {dg.AssetKey.from_user_string(a): b for a, b in built}
            if error is not None:
                errors[key] = error
            finished(key)

        run_in_processes(keys, processes.task, processes.job, workers, ended, processes.where)
        return

    def one(key: str) -> tuple[dict[dg.AssetKey, Built], str | None]:
        out: dict[dg.AssetKey, Built] = {}
        try:
            for asset, built in build(key):
                out[asset] = built
        except Exception as exc:
            return out, partition_error(exc)
        return out, None

    def take(future: Future) -> str:
        out, error = future.result()
        key = futures[future]
        done[key] = out
        if error is not None:
            errors[key] = error
        return key

    pool = ThreadPoolExecutor(workers, thread_name_prefix="partition")
    futures: dict[Future, str] = {}
    try:
        for key in keys:  # an interrupt can come while these are submitted
            futures[pool.submit(one, key)] = key
        for future in as_completed(futures):
            finished(take(future))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        # Partitions that finished before the interrupt was seen are committed: keep them.
        for future, key in futures.items():
            if key not in done and future.done() and not future.cancelled():
                take(future)
        raise
    pool.shutdown()
