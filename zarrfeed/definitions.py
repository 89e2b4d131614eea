"""The Dagster code location (``dagster dev -w workspace.yaml``), assembled here only."""

import os

import dagster as dg

from zarrfeed.assets import ct_assets
from zarrfeed.jobs import ct_build, ct_scan_discovery
from zarrfeed.resources import CTSettings, RawFolderResource, ZarrStoreResource


def usable_cpus() -> int:
    """CPUs this process may run on (affinity), not the host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


defs = dg.Definitions(
    assets=ct_assets,
    jobs=[ct_build],
    sensors=[ct_scan_discovery],
    resources={
        "zarr_store": ZarrStoreResource(),
        "raw": RawFolderResource(),
        "ct_settings": CTSettings(),
    },
    executor=dg.multiprocess_executor.configured({"max_concurrent": usable_cpus()}),
)
