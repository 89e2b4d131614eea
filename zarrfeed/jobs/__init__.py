"""Jobs, sensors and schedules of the code location."""

from zarrfeed.jobs.automation import datasets_automation, training_automation
from zarrfeed.jobs.build import (
    build_jobs,
    datasets_build,
    hub_catalog,
    store_maintenance,
    train,
)
from zarrfeed.jobs.discovery import discovery_sensor
from zarrfeed.jobs.liveness import dead_runs
from zarrfeed.jobs.nightly import nightly_schedule, store_maintenance_nightly

jobs = [*build_jobs.values(), datasets_build, hub_catalog, train, store_maintenance]
sensors = [
    *(discovery_sensor(f, j) for f, j in build_jobs.items()),
    datasets_automation,
    training_automation,
    dead_runs,
]
schedules = [*(nightly_schedule(f, j) for f, j in build_jobs.items()), store_maintenance_nightly]

__all__ = ["build_jobs", "jobs", "schedules", "sensors"]
