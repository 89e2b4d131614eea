"""Per-partition materialisations of a batched (partition-range) run, each with its own data
version.

Dagster 1.13 records one data version per asset per step: a step that returns one result
for a range of partitions gives every partition the same version, so a changed raw item
would make every partition of its batch look stale, and a partition that failed would be
recorded as materialised.  A batched step therefore logs one ``AssetMaterialization`` per
partition it committed — with the data-version, code-version and input-provenance tags
Dagster itself writes for a one-partition run, the upstream versions read per partition —
and returns its result marked as logged by the step, so no range-wide event follows (the
two things Dagster offers no public way for, in ``zarrfeed.assets.compat``).
``tests/test_backfill.py`` pins this behaviour: exactly one materialisation per committed
partition, carrying that partition's version.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from zarrfeed.assets.compat import INITIAL, LOGGED_BY_STEP, data_version_of, provenance_tags
from zarrfeed.assets.metadata import readable

Checks = Mapping[str, tuple[bool, dict[str, Any]]]


def upstream_versions(
    instance: dg.DagsterInstance, upstream: dg.AssetKey, partitions: Sequence[str]
) -> dict[str, tuple[str, int]]:
    """Partition -> (data version, storage id) of the latest materialisation of each of
    ``partitions`` of ``upstream``: two queries, whatever the number of partitions."""
    ids = instance.event_log_storage.get_latest_storage_id_by_partition(
        upstream, dg.DagsterEventType.ASSET_MATERIALIZATION, set(partitions)
    )
    if not ids:
        return {}
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=upstream, storage_ids=list(ids.values())), limit=len(ids)
    ).records
    out = {}
    for record in records:
        version = data_version_of(record.event_log_entry.tags)
        if record.partition_key is not None and version is not None:
            out[record.partition_key] = (version, record.storage_id)
    return out


class PartitionRecorder:
    """Records the partitions of a batched step one at a time, as each commits: a
    materialisation of each asset it built at its data version, with its code version and
    the latest data version of each upstream partition it read (the tags Dagster writes for
    a one-partition run), then its check results (those selected in this run).

    The upstream versions of every partition of the step are read once, up front (two
    queries per upstream asset): the upstream partitions a step reads are committed before
    it starts.  Recording a partition while the others build puts the event writes beside
    the work instead of after it.
    """

    def __init__(
        self,
        context: dg.AssetExecutionContext,
        assets: Sequence[dg.AssetKey],
        partitions: Sequence[str],
    ) -> None:
        self.context = context
        assets_def = context.assets_def
        deps = {asset: sorted(assets_def.asset_deps.get(asset, ())) for asset in assets}
        for asset, ups in deps.items():  # read up front, a sibling's version would be stale
            if inside := [up.to_user_string() for up in ups if up in assets]:
                raise ValueError(
                    f"{asset.to_user_string()} reads {', '.join(inside)} built in the same "
                    "step: a batched step records upstream versions read before it builds"
                )
        read = {up for ups in deps.values() for up in ups}
        versions = {up: upstream_versions(context.instance, up, partitions) for up in read}
        self._upstream = {asset: {up: versions[up] for up in ups} for asset, ups in deps.items()}
        self._code = {asset: assets_def.code_versions_by_key.get(asset) for asset in assets}
        selected = context.selected_asset_check_keys
        self._checks = {asset: [k for k in selected if k.asset_key == asset] for asset in assets}
        self.checks: dict[dg.AssetKey, dict[str, Checks]] = {asset: {} for asset in assets}
        """Per asset: partition -> its check results, for each partition recorded."""

    def record(
        self,
        partition: str,
        asset: dg.AssetKey,
        metadata: Mapping[str, Any],
        data_version: str,
        results: Checks,
    ) -> None:
        """Record partition ``partition`` of ``asset``: its materialisation, then its checks."""
        upstream = {
            up: versions.get(partition, (INITIAL, None))
            for up, versions in self._upstream[asset].items()
        }
        tags = provenance_tags(data_version, self._code[asset], upstream)
        log = self.context.log_event
        log(
            dg.AssetMaterialization(
                asset_key=asset, partition=partition, metadata=metadata, tags=tags
            )
        )
        for check in self._checks[asset]:
            passed, facts = results[check.name]
            log(
                dg.AssetCheckEvaluation(
                    asset_key=asset,
                    check_name=check.name,
                    passed=passed,
                    metadata=readable(facts),
                    blocking=True,
                    partition=partition,
                )
            )
        self.checks[asset][partition] = results


def logged(
    context: dg.AssetExecutionContext, asset: dg.AssetKey, checks: Mapping[str, Checks]
) -> dg.MaterializeResult:
    """The step's result for ``asset`` when a :class:`PartitionRecorder` recorded its
    partitions (``checks``: partition -> its check results).

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
