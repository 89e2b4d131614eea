"""Per-partition materialisations of a batched (partition-range) run, each with its own data
version.

Dagster 1.13 records one data version per asset per step: a step that returns one result
for a range of partitions gives every partition the same version, so a changed raw item
would make every partition of its batch look stale, and a partition that failed would be
recorded as materialised.  A batched step therefore logs one ``AssetMaterialization`` per
partition it committed — with the data-version, code-version and input-provenance tags
Dagster itself writes for a one-partition run, the upstream versions read per partition —
and returns its result with the marker Dagster reads as "the step logged its own events"
(the marker its auto-converted observable source assets use), so no range-wide event
follows.  ``tests/test_backfill.py`` pins this behaviour: exactly one materialisation per
committed partition, carrying that partition's version.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg
from dagster._core.definitions.data_version import (
    CODE_VERSION_TAG,
    DATA_VERSION_IS_USER_PROVIDED_TAG,
    DATA_VERSION_TAG,
    NULL_EVENT_POINTER,
    extract_data_version_from_entry,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)
from dagster._core.definitions.source_asset import (
    SYSTEM_METADATA_KEY_SOURCE_ASSET_OBSERVATION as LOGGED_BY_STEP,
)

from zarrfeed.assets.metadata import readable

Checks = Mapping[str, tuple[bool, dict[str, Any]]]


def version_tags(
    instance: dg.DagsterInstance,
    asset: dg.AssetKey,
    partition: str,
    data_version: str,
    code_version: str | None,
    upstream: Sequence[dg.AssetKey],
) -> dict[str, str]:
    """The tags of a materialisation of ``asset[partition]`` at ``data_version``: its code
    version and the latest data version (and event) of each upstream partition."""
    tags = {DATA_VERSION_TAG: data_version, DATA_VERSION_IS_USER_PROVIDED_TAG: "true"}
    if code_version is not None:
        tags[CODE_VERSION_TAG] = code_version
    for key in upstream:
        record = instance.get_latest_data_version_record(key, partition_key=partition)
        version = extract_data_version_from_entry(record.event_log_entry) if record else None
        tags[get_input_data_version_tag(key)] = (version or dg.DataVersion("INITIAL")).value
        tags[get_input_event_pointer_tag(key)] = (
            str(record.storage_id) if record else NULL_EVENT_POINTER
        )
    return tags


def log_partition(
    context: dg.AssetExecutionContext,
    asset: dg.AssetKey,
    partition: str,
    metadata: Mapping[str, Any],
    data_version: str,
    checks: Checks,
) -> None:
    """Record ``asset[partition]`` as materialised at ``data_version``, then its check
    results (those selected in this run) as that partition's."""
    assets_def = context.assets_def
    tags = version_tags(
        context.instance,
        asset,
        partition,
        data_version,
        assets_def.code_versions_by_key.get(asset),
        sorted(assets_def.asset_deps.get(asset, ())),
    )
    context.log_event(
        dg.AssetMaterialization(asset_key=asset, partition=partition, metadata=metadata, tags=tags)
    )
    for check in context.selected_asset_check_keys:
        if check.asset_key != asset:
            continue
        passed, facts = checks[check.name]
        context.log_event(
            dg.AssetCheckEvaluation(
                asset_key=asset,
                check_name=check.name,
                passed=passed,
                metadata=readable(facts),
                blocking=True,
                partition=partition,
            )
        )


def logged(
    context: dg.AssetExecutionContext, asset: dg.AssetKey, checks: Mapping[str, Checks]
) -> dg.MaterializeResult:
    """The step's result for ``asset`` when :func:`log_partition` recorded its partitions
    (``checks``: partition -> its check results).

    Each selected check also gets a step-wide result — Dagster starts the next steps only
    once every output of this one exists — that names the partitions that failed it.  It
    never stops the next steps for every partition (a failure is a warning): a partition
    that failed a check is refused by the stages that read it, on its own.
    """
    results = []
    for check in context.selected_asset_check_keys:
        if check.asset_key != asset:
            continue
        failed = sorted(p for p, c in checks.items() if not c[check.name][0])
        results.append(
            dg.AssetCheckResult(
                asset_key=asset,
                check_name=check.name,
                passed=not failed,
                severity=dg.AssetCheckSeverity.WARN if failed else dg.AssetCheckSeverity.ERROR,
                metadata={"partitions": len(checks), "failed_partitions": failed},
            )
        )
    return dg.MaterializeResult(
        asset_key=asset, metadata={LOGGED_BY_STEP: True}, check_results=results
    )
