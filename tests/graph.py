"""Helpers for tests that build the asset graph on a real Dagster instance.

A test's ``resources`` dict says where things are (``zarr_store``, ``raw``, ``models``) and,
under ``<family>_settings``, the settings a family's definitions are built with (small CT
settings for speed); the helpers build each family's definitions from its declaration with
those settings, as its component does from YAML.
"""

from __future__ import annotations

import contextvars
from typing import Any

import dagster as dg

from zarrfeed.assets import family_assets as declared_assets
from zarrfeed.assets.datasets import dataset_asset
from zarrfeed.components import family_defs
from zarrfeed.families.ct import CT
from zarrfeed.families.images import IMAGES
from zarrfeed.families.spike import SPIKE
from zarrfeed.jobs.discovery import discover_into

FAMILIES = {f.name: f for f in (CT, SPIKE, IMAGES)}


def base_resources() -> dict[str, Any]:
    """The resources the code location registers besides where things are, as it does."""
    from zarrfeed.assets.torchrun import TorchrunResource
    from zarrfeed.resources import BuildOptions, HuggingFaceResource

    return {"build": BuildOptions(), "hf": HuggingFaceResource(), "torchrun": TorchrunResource()}


def settings(resources: dict, family: str) -> dict[str, Any]:
    """The settings ``family`` is built with in this test (its defaults where none given)."""
    return FAMILIES[family].values(resources.get(f"{family}_settings"))


def runtime(resources: dict) -> dict[str, Any]:
    """``resources`` without the families' settings (definitions take those, not runs)."""
    return {k: v for k, v in resources.items() if not k.endswith("_settings")}


def family_assets(family: str, resources: dict) -> list[dg.AssetsDefinition]:
    return declared_assets(FAMILIES[family], settings(resources, family))


def dataset_assets() -> list[dg.AssetsDefinition]:
    return [dataset_asset(f) for f in FAMILIES.values()]


def model_assets() -> list[dg.AssetsDefinition]:
    from zarrfeed.assets.training import model_asset
    from zarrfeed.training.tasks import TASK_TYPES

    return [model_asset(task) for task in TASK_TYPES]


def definitions(resources: dict, family: str) -> dg.Definitions:
    """``family``'s definitions (assets, jobs, sensor, schedule) built with the test's
    settings, with the test's resources."""
    defs = family_defs(FAMILIES[family], settings(resources, family))
    return dg.Definitions(
        assets=defs.assets,
        jobs=defs.jobs,
        sensors=defs.sensors,
        schedules=defs.schedules,
        resources={**(defs.resources or {}), **runtime(resources)},
    )


def sensor(resources: dict, name: str) -> dg.SensorDefinition:
    family = name.rsplit("_", 1)[0]
    return definitions(resources, family).resolve_sensor_def(name)


def schedule(resources: dict, name: str) -> dg.ScheduleDefinition:
    family = name.rsplit("_", 1)[0]
    return definitions(resources, family).resolve_schedule_def(name)


def discover(instance: dg.DagsterInstance, resources: dict, family: str) -> list[str]:
    """Catalogue the raw folder's items of ``family`` and add their partitions."""
    return discover_into(instance, FAMILIES[family], resources["raw"], resources["zarr_store"])


def materialize(assets: list, instance: dg.DagsterInstance, **kw) -> dg.ExecuteInProcessResult:
    """``dg.materialize`` in a fresh context: an instance entered earlier in this process
    leaves its definitions-state storage in a context variable, and once that instance is
    gone Dagster's definitions loading fails on the dead reference (seen in a full test run,
    never alone).  The run's own instance is passed explicitly, so nothing else is needed."""
    if "resources" in kw:
        kw["resources"] = runtime(kw["resources"])
    return contextvars.Context().run(dg.materialize, assets, instance=instance, **kw)


def build(resources: dict, instance: dg.DagsterInstance, family: str, key: str, **kw):
    """Materialise every asset of ``family`` for one partition."""
    assets = family_assets(family, resources)
    return materialize(assets, instance, partition_key=key, resources=resources, **kw)


def build_datasets(resources: dict, instance: dg.DagsterInstance, **kw):
    return materialize(dataset_assets(), instance, resources=resources, **kw)


def checks(result) -> dict[tuple[str, str], bool]:
    return {(c.asset_key.to_user_string(), c.check_name): c.passed
            for c in result.get_asset_check_evaluations()}  # fmt: skip


def requested(requests, order: list[str]) -> dict[str, str]:
    """Partition key -> reason of every partition the build-run ``requests`` (partition
    ranges expanded in the partitions' ``order``) ask for, in request order."""
    from zarrfeed.jobs.requests import RANGE_END, RANGE_START, REASON

    out: dict[str, str] = {}
    for r in requests:
        if REASON not in r.tags:
            continue  # not a build run (a dataset manifest's)
        if r.partition_key is not None:
            keys = [r.partition_key]
        else:
            start, end = order.index(r.tags[RANGE_START]), order.index(r.tags[RANGE_END])
            keys = order[start : end + 1]
        out.update(dict.fromkeys(keys, r.tags[REASON]))
    return out


def failure(result) -> str:
    """The first step failure's message and cause chain, as text."""
    event = next(e for e in result.all_events if e.is_step_failure)
    return event.event_specific_data.error.to_string()
