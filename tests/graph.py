"""Helpers for tests that build the asset graph on a real Dagster instance."""

from __future__ import annotations

import contextvars

import dagster as dg

from zarrfeed.assets import dataset_assets, family_assets
from zarrfeed.jobs.discovery import discover_into


def discover(instance: dg.DagsterInstance, resources: dict, family: str) -> list[str]:
    """Catalogue the raw folder's items of ``family`` and add their partitions."""
    return discover_into(instance, family, resources["raw"], resources["zarr_store"])


def materialize(assets: list, instance: dg.DagsterInstance, **kw) -> dg.ExecuteInProcessResult:
    """``dg.materialize`` in a fresh context: an instance entered earlier in this process
    leaves its definitions-state storage in a context variable, and once that instance is
    gone Dagster's definitions loading fails on the dead reference (seen in a full test run,
    never alone).  The run's own instance is passed explicitly, so nothing else is needed."""
    return contextvars.Context().run(dg.materialize, assets, instance=instance, **kw)


def build(resources: dict, instance: dg.DagsterInstance, family: str, key: str, **kw):
    """Materialise every asset of ``family`` for one partition."""
    assets = family_assets(family, resources)
    return materialize(assets, instance, partition_key=key, resources=resources, **kw)


def build_datasets(resources: dict, instance: dg.DagsterInstance, **kw):
    return materialize(dataset_assets, instance, resources=resources, **kw)


def checks(result) -> dict[tuple[str, str], bool]:
    return {(c.asset_key.to_user_string(), c.check_name): c.passed
            for c in result.get_asset_check_evaluations()}  # fmt: skip


def failure(result) -> str:
    """The first step failure's message and cause chain, as text."""
    event = next(e for e in result.all_events if e.is_step_failure)
    return event.event_specific_data.error.to_string()
