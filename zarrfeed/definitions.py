"""The Dagster code location (``dg dev -w workspace.yaml``), assembled here only."""

import os

import dagster as dg

from zarrfeed.assets import make_assets
from zarrfeed.assets.torchrun import TorchrunResource
from zarrfeed.errors import ConfigError
from zarrfeed.jobs import jobs, schedules, sensors
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


def executor() -> dg.ExecutorDefinition:
    """Where a run's steps execute, from ``ZARRFEED_EXECUTOR``: ``multiprocess`` (the default,
    embedded: subprocesses of the run) or ``celery`` (production: Celery workers listening on
    the broker named by ``ZARRFEED_CELERY_BROKER``, the same variable the workers read in
    ``deploy/celery.yaml``, so the two cannot name different brokers; see deploy/README.md)."""
    kind = os.environ.get("ZARRFEED_EXECUTOR", "multiprocess")
    if kind == "multiprocess":
        return dg.multiprocess_executor.configured({"max_concurrent": usable_cpus()})
    if kind == "celery":
        from dagster_celery import celery_executor

        return celery_executor.configured(
            {
                "broker": {"env": "ZARRFEED_CELERY_BROKER"},
                "backend": {"env": "ZARRFEED_CELERY_BACKEND"},
            }
        )
    raise ConfigError(f"ZARRFEED_EXECUTOR={kind!r}: expected 'multiprocess' or 'celery'")


# Where things are comes from the environment at run time (dg.EnvVar; the repository's .env
# gives the defaults to the dagster CLI, `zarrfeed demo` sets them itself); what the data
# looks like is configuration, from which the assets' code versions derive.
RESOURCES = {
    "zarr_store": ZarrStoreResource(url=dg.EnvVar("ZARRFEED_STORE")),
    "raw": RawFolderResource(root=dg.EnvVar("ZARRFEED_RAW")),
    "build": BuildOptions(),
    "ct_settings": CTSettings(),
    "spike_settings": SpikeSettings(),
    "image_settings": ImageSettings(),
    "hf": HuggingFaceResource(),
    "models": ModelsResource(root=dg.EnvVar("ZARRFEED_MODELS")),
    "torchrun": TorchrunResource(),
}

defs = dg.Definitions(
    assets=make_assets(RESOURCES),
    jobs=jobs,
    sensors=sensors,
    schedules=schedules,
    resources=RESOURCES,
    executor=executor(),
)
