"""A family's partitioned assets, derived from its declaration: raw ingest, and one Dagster
step per stage (or per group of stages that share a step).

Code versions and fingerprints come from the same settings: the values handed in here, which
the family's component reads from its YAML.  A changed setting therefore gives the assets
that declare it a new code version (the UI shows them stale) and their partitions new
fingerprints (the nightly schedule rebuilds them) at once; no run config can make the two
disagree.
"""

from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import dagster as dg

from zarrfeed.assets.build import (
    Built,
    InProcesses,
    materialize_partitions,
    stored_asset,
    stored_multi_asset,
)
from zarrfeed.assets.partitions import partitions_def
from zarrfeed.assets.raw import item_bytes, raw_asset
from zarrfeed.assets.workers import (
    HubFetch,
    StageJob,
    build_in_worker,
    configured,
    stage_builds,
)
from zarrfeed.families import Family, Inputs, Stage
from zarrfeed.processes import usable_cpus


def steps(family: Family) -> dict[str, list[Stage]]:
    """Step name -> the stages it builds, in declaration order."""
    out: dict[str, list[Stage]] = {}
    for stage in family.stages:
        out.setdefault(stage.step or stage.asset.name, []).append(stage)
    return out


def stage_asset(
    family: Family, name: str, stages: list[Stage], values: Mapping[str, Any]
) -> dg.AssetsDefinition:
    """The Dagster step that builds ``stages`` (any subset of them when there are several)."""
    partitions = partitions_def(family)
    resources = {"zarr_store", "build"} | ({"hf"} if family.hub else set())
    specs = [s.asset for s in stages]
    deps = {s.name: family.upstream_keys(s) for s in specs}

    def build_each(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult]:
        res = context.resources
        store = res.zarr_store.store()
        fetch = HubFetch(res.hf) if family.hub else None
        catalog = res.zarr_store.catalog(family.name)
        inputs = Inputs(family, store, catalog, values, fetch)
        chosen = [
            s
            for s in stages
            if len(stages) == 1 or dg.AssetKey(s.asset.name) in context.selected_asset_keys
        ]

        force = res.build.force

        def one(partition: str) -> Iterator[tuple[dg.AssetKey, Built]]:
            """The chosen stages of ``partition``, in order (a failure stops the rest)."""
            yield from stage_builds(inputs, store, chosen, values, force, partition)

        def where(partition: str) -> str:
            item = catalog.index().get(partition)
            return f"partition {partition} ({item.location if item else 'no raw item'})"

        cpus = usable_cpus()
        job = StageJob(
            family,
            dict(values),
            tuple(s.asset.name for s in chosen),
            configured(res.zarr_store),
            configured(res.hf) if family.hub else None,
            force,
            threads=max(1, cpus // min(cpus, len(context.partition_keys))),
        )
        assets = [dg.AssetKey(s.asset.name) for s in chosen]
        size = partial(item_bytes, family, catalog, context.partition_keys)
        processes = InProcesses(build_in_worker, job, where)
        yield from materialize_partitions(context, assets, one, size, processes)

    if len(stages) == 1:
        spec = specs[0]

        @stored_asset(spec, values, partitions, deps[spec.name], resources)
        def single(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult]:
            yield from build_each(context)

        return single

    @stored_multi_asset(name, specs, values, partitions, deps, resources)
    def several(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult]:
        """Stages built in one step from one read of what they share (any subset of them)."""
        yield from build_each(context)

    return several


def family_assets(family: Family, settings: Mapping[str, Any]) -> list[dg.AssetsDefinition]:
    """The partitioned assets of ``family`` — raw ingest and its stages, what its build job
    builds — with ``settings`` (validated by the family's model: what is not given takes its
    default)."""
    values = family.values(settings)
    stages = [stage_asset(family, name, group, values) for name, group in steps(family).items()]
    return [raw_asset(family), *stages]
