"""How every partitioned asset runs: one partition or a batch, reuse or rebuild, then checks.

An asset supplies ``build(key) -> Built``; :func:`materialize_partitions` runs it for the run's
partition (sensor, schedule and UI runs) or for each partition of a batched backfill run, and
turns the results into one ``MaterializeResult``.  Dagster 1.13 records one materialisation
and one check result per asset per step, whatever the number of partitions, so a batch reports
per-partition facts in a table and a check passes only when it passed for every partition.
"""

import hashlib
import json
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from zarrfeed.assets.metadata import partition_metadata
from zarrfeed.errors import ZarrfeedError
from zarrfeed.store import ZarrStore, read_array

# backfill_policy= is marked beta in dagster 1.13; it is the documented way to batch.
warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*backfill_policy")

# Backfills of derived assets run this many partitions per run: the ~1–2 s start-up of a run
# is paid once per batch instead of once per partition (benchmarks/build.py).
BATCH = dg.BackfillPolicy.multi_run(max_partitions_per_run=16)


@dataclass
class Built:
    """What building (or reusing) one partition reports."""

    metadata: dict[str, Any]
    checks: dict[str, tuple[bool, dict[str, Any]]] = field(default_factory=dict)
    data_version: str | None = None


def fingerprint(code_version: str, params: Mapping[str, Any], inputs: Mapping[str, Any]) -> str:
    """A hash of everything a partition's content depends on (stored in its provenance)."""
    blob = json.dumps([code_version, params, inputs], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def upstream_input(store: ZarrStore, asset: str, key: str) -> dict[str, Any]:
    """The identity of an upstream partition as an input of a fingerprint."""
    attrs = store.commit_record(asset, key)["attrs"]
    return {
        "asset": asset,
        "fingerprint": attrs.get("fingerprint"),
        "sha": attrs.get("source_sha256"),
    }


def reuse(store: ZarrStore, asset: str, key: str, fp: str, force: bool) -> bool:
    """True when the committed partition was built from the same inputs, code and params."""
    if force or not store.has_partition(asset, key):
        return False
    return store.commit_record(asset, key)["attrs"].get("fingerprint") == fp


def checked_arrays(
    store: ZarrStore, asset: str, key: str, fresh: dict[str, Any] | None
) -> dict[str, Any]:
    """The arrays the checks run on: those just written, or the stored ones when reused.

    Reading a fresh partition back would double its I/O (about 40 % of the CT windows
    step); a reused partition is read, so corruption on disk fails its checks.
    """
    if fresh is not None:
        return fresh
    group = store.open_partition(asset, key)
    return {name: read_array(group[name]) for name in sorted(group.array_keys())}


def report(store: ZarrStore, asset: str, key: str, seconds: float | None, **extra: Any) -> dict:
    """Standard metadata of a partition; ``seconds=None`` marks a reused partition."""
    meta = partition_metadata(store, asset, key, seconds or 0.0)
    return {**meta, "reused": seconds is None, **extra}


def partitioned_asset(
    *,
    partitions_def: dg.PartitionsDefinition,
    group: str,
    code_version: str,
    checks: tuple[str, ...],
    deps: tuple = (),
    batched: bool = True,
) -> Callable:
    """``@dg.asset`` with zarrfeed's conventions: blocking checks, batched backfills."""

    def wrap(fn: Callable) -> dg.AssetsDefinition:
        return dg.asset(
            partitions_def=partitions_def,
            deps=list(deps),
            group_name=group,
            code_version=code_version,
            backfill_policy=BATCH if batched else None,
            check_specs=[dg.AssetCheckSpec(c, asset=fn.__name__, blocking=True) for c in checks],
        )(fn)

    return wrap


def partitioned_multi_asset(
    *,
    name: str,
    partitions_def: dg.PartitionsDefinition,
    group: str,
    assets: Mapping[str, tuple[str, tuple[str, ...], tuple[str, ...], Callable]],
) -> Callable:
    """``@dg.multi_asset`` over ``assets`` (name -> code version, checks, deps, builder whose
    docstring describes the asset), subsettable, with the same conventions as
    :func:`partitioned_asset`."""

    def wrap(fn: Callable) -> dg.AssetsDefinition:
        return dg.multi_asset(
            name=name,
            specs=[
                dg.AssetSpec(
                    key,
                    deps=list(deps),
                    group_name=group,
                    code_version=version,
                    description=builder.__doc__,
                )
                for key, (version, _, deps, builder) in assets.items()
            ],
            check_specs=[
                dg.AssetCheckSpec(c, asset=key, blocking=True)
                for key, (_, checks, _, _) in assets.items()
                for c in checks
            ],
            partitions_def=partitions_def,
            backfill_policy=BATCH,
            can_subset=True,
        )(fn)

    return wrap


def materialize_partitions(
    context: dg.AssetExecutionContext,
    build: Callable[[str], Built],
    asset_key: dg.AssetKey | None = None,
) -> dg.MaterializeResult:
    """Build every partition of the run and report them with the selected checks (of
    ``asset_key`` when the step materialises several assets)."""
    check_names = [
        k.name
        for k in context.selected_asset_check_keys
        if asset_key is None or k.asset_key == asset_key
    ]
    keys = context.partition_keys

    def check(n: str, passed: bool, metadata: dict[str, Any]) -> dg.AssetCheckResult:
        return dg.AssetCheckResult(
            asset_key=asset_key, check_name=n, passed=passed, metadata=metadata
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
