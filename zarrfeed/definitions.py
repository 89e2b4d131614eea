"""The Dagster code location (``dagster dev -w workspace.yaml``), assembled here only."""

import os

import dagster as dg

from zarrfeed.assets import all_assets
from zarrfeed.jobs import (
    build_jobs,
    datasets_automation,
    datasets_build,
    hub_build,
    hub_catalog,
    schedules,
    sensors,
    train,
    training_automation,
)
from zarrfeed.resources import (
    BuildOptions,
    CTSettings,
    HuggingFaceResource,
    ImageSettings,
    ModelsResource,
    RawFolderResource,
    SpikeSettings,
    ZarrStoreResource,
)


def usable_cpus() -> int:
    """CPUs this process may run on (affinity), not the host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


RESOURCES = {
    "zarr_store": ZarrStoreResource(),
    "raw": RawFolderResource(),
    "build": BuildOptions(),
    "ct_settings": CTSettings(),
    "spike_settings": SpikeSettings(),
    "image_settings": ImageSettings(),
    "hf": HuggingFaceResource(),
    "models": ModelsResource(),
}

defs = dg.Definitions(
    assets=all_assets,
    jobs=[*build_jobs.values(), datasets_build, hub_catalog, hub_build, train],
    sensors=[*sensors, datasets_automation, training_automation],
    schedules=schedules,
    resources=RESOURCES,
    executor=dg.multiprocess_executor.configured({"max_concurrent": usable_cpus()}),
)
