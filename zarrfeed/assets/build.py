"""How every stored asset's partitions are built: one routine, driven by the data contract.

A family's builder supplies a :class:`~zarrfeed.families.Step` per partition — its
fingerprint inputs, how to produce its arrays, how to check them — and
:func:`build_partition` does the rest the same way for all:

1. the fingerprint from the contract (code version, declared settings, inputs);
2. reuse when the committed partition has that fingerprint and its stored data still passes
   the checks (stored data that fails them is rebuilt: corruption heals itself);
3. otherwise produce, conform to the contract (names, dtypes, dims), check **before
   committing**, and commit the arrays with their provenance and check results — a
   partition that fails a blocking check is committed for inspection but never enters a
   dataset (``store.contract.failed_checks``);
4. the metadata and check results Dagster records.

:func:`materialize_partitions` runs it for the run's partition or for each partition of a
batched backfill run; :func:`stored_asset` and :func:`stored_multi_asset` declare the Dagster
assets from the contract.
"""

import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import numpy as np

from zarrfeed.assets.metadata import partition_metadata, readable, shown
from zarrfeed.errors import ZarrfeedError
from zarrfeed.families.stages import Checks, Step
from zarrfeed.store import ZarrStore, provenance
from zarrfeed.store.checksums import ATTR, array_sha256
from zarrfeed.store.contract import StoredAsset, stale_reason

# Backfills of derived assets run this many partitions per run: the ~1–2 s start-up of a run
# is paid once per batch instead of once per partition (benchmarks/build.py).
BATCH = dg.BackfillPolicy.multi_run(max_partitions_per_run=16)
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
    """What building (or reusing) one partition reports."""

    metadata: dict[str, Any]
    checks: Checks = field(default_factory=dict)
    data_version: str | None = None


def stored_arrays(store: ZarrStore, spec: StoredAsset, key: str) -> dict[str, np.ndarray]:
    names = sorted(store.commit_record(spec.path, key)["arrays"])
    return {name: store.read_array(spec.path, key, name) for name in names}


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
        arrays = stored_arrays(store, spec, key)
        checks = conform_checks(spec, step.check(arrays))
        recorded = (record or {}).get("checks") or {}
        if all(ok == recorded.get(n, True) for n, (ok, _) in checks.items()):
            metadata = partition_metadata(store, spec.path, key, None, "unchanged inputs")
            return Built({**metadata, **described(step, arrays)}, checks, fingerprint)
        why = "stored data failed its checks"
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
    with ThreadPoolExecutor(1, thread_name_prefix="checksum") as pool:
        # The checksums are computed beside the checks and the write (hashlib releases the
        # GIL): hashing a CT volume takes as long as coding it.
        sums = pool.submit(lambda: {name: array_sha256(d) for name, d in arrays.items()})
        checks = conform_checks(spec, step.check(arrays))
        attrs = provenance(
            step.source,
            step.source_sha256,
            spec.version,
            spec.settings_of(settings, key),
            fingerprint=fingerprint,
            **step.attrs,
        )
        with store.write_partition(spec.path, key, attrs) as w:
            for name, data in arrays.items():
                a = spec.array(name)
                w.write(name, data, read=a.read, content=a.content, dimension_names=a.dims)
            w.checks = {n: ok for n, (ok, _) in checks.items()}
            w.attrs[ATTR] = sums.result()
    seconds = time.perf_counter() - t0
    metadata = partition_metadata(store, spec.path, key, seconds, why)
    return Built({**metadata, **described(step, arrays)}, checks, fingerprint)


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


def materialize_partitions(
    context: dg.AssetExecutionContext,
    build: Callable[[str], Built],
    asset_key: dg.AssetKey | None = None,
) -> dg.MaterializeResult:
    """Build every partition of the run and report them with the selected checks (of
    ``asset_key`` when the step materialises several assets).

    A run of one partition reports its checks as that partition's.  Dagster 1.13 records one
    materialisation and one check result per asset per step whatever the number of
    partitions, so a batch reports per-partition facts in a table, logs each partition's
    check results as that partition's, and its step's own result passes only when the check
    passed for every partition.
    """
    check_names = [
        k.name
        for k in context.selected_asset_check_keys
        if asset_key is None or k.asset_key == asset_key
    ]
    keys = context.partition_keys

    def check(n: str, passed: bool, metadata: dict[str, Any]) -> dg.AssetCheckResult:
        return dg.AssetCheckResult(
            asset_key=asset_key, check_name=n, passed=passed, metadata=readable(metadata)
        )

    if len(keys) == 1:
        built = build(keys[0])
        return dg.MaterializeResult(
            asset_key=asset_key,
            metadata=built.metadata,
            data_version=dg.DataVersion(built.data_version) if built.data_version else None,
            check_results=[check(n, *built.checks[n]) for n in check_names],
        )
    t0 = time.perf_counter()
    results: dict[str, Built] = {}
    errors: dict[str, str] = {}
    for key in keys:
        try:
            results[key] = build(key)
        except (ZarrfeedError, dg.Failure, OSError, ValueError) as exc:
            errors[key] = str(exc)
            context.log.error(f"partition {key} failed: {exc}")
    if errors:
        # Good partitions are committed and will be reused by the retry; the failing ones
        # are named so the retry (or a single-partition run) can be aimed at them.
        raise dg.Failure(
            description=f"{len(errors)} of {len(keys)} partitions failed: "
            + "; ".join(f"{k}: {e}" for k, e in errors.items()),
            metadata={"failed": dg.MetadataValue.json(errors)},
        )
    checked = asset_key or context.assets_def.key
    for key, built in results.items():
        for n in check_names:
            passed, metadata = built.checks[n]
            context.log_event(
                dg.AssetCheckEvaluation(
                    asset_key=checked,
                    check_name=n,
                    passed=passed,
                    metadata=readable(metadata),
                    blocking=True,
                    partition=key,
                )
            )
    rows = {
        k: {n: v for n, v in b.metadata.items() if isinstance(v, int | float | str | bool)}
        for k, b in results.items()
    }
    return dg.MaterializeResult(
        asset_key=asset_key,
        metadata={
            "batch_partitions": len(keys),
            "batch_seconds": round(time.perf_counter() - t0, 3),
            "partitions": dg.MetadataValue.json(rows),
        },
        check_results=[
            check(
                n,
                all(b.checks[n][0] for b in results.values()),
                {"failed_partitions": [k for k, b in results.items() if not b.checks[n][0]]},
            )
            for n in check_names
        ],
    )
