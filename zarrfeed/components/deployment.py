"""What differs between deployments, and what every family shares.

The executor is the one choice: ``multiprocess`` (embedded: ``zarrfeed demo``, ``dg dev`` on
a laptop; steps run in subprocesses of the run, or all in the run's own process where its run
config sets ``execution: {config: {in_process: true}}``, as the demo's runs do) or ``celery``
(production: steps run on Celery workers listening on the broker named by
``ZARRFEED_CELERY_BROKER``, the variable the workers read in ``deploy/celery.yaml``, so the two
cannot name different brokers).  Where the store,
the raw folder and the models are comes from the environment when a run starts
(``dg.EnvVar``: the repository's ``.env`` gives the dagster CLI its defaults, ``zarrfeed demo``
sets them).  The store-wide jobs and sensors live here too: the dataset manifests' job and
automation, store maintenance, and the sensor that fails runs whose process died.
"""

from __future__ import annotations

from typing import Literal

import dagster as dg

from zarrfeed.jobs.automation import datasets_automation
from zarrfeed.jobs.build import datasets_build, store_maintenance
from zarrfeed.jobs.liveness import IN_PROCESS, dead_runs
from zarrfeed.jobs.nightly import store_maintenance_nightly
from zarrfeed.processes import usable_cpus
from zarrfeed.resources import BuildOptions, RawFolderResource, ZarrStoreResource

# A step that fails some partitions of a batched run still commits and records the others
# (zarrfeed.assets.build.materialize_partitions); the next steps build on those rather than
# waiting for a retry.  (Celery's executor has no such setting: there a retry builds them.)
ON_PARTIAL_FAILURE = {"step_dependency_config": {"require_upstream_step_success": False}}


def executor(kind: str) -> dg.ExecutorDefinition:
    if kind == "celery":
        from dagster_celery import celery_executor

        return celery_executor.configured(
            {
                "broker": {"env": "ZARRFEED_CELERY_BROKER"},
                "backend": {"env": "ZARRFEED_CELERY_BACKEND"},
            }
        )
    return dg.multi_or_in_process_executor.configured(
        local_executor,
        config_schema={
            IN_PROCESS: dg.Field(
                bool,
                default_value=False,
                description="every step in the run's own process: no process a step to start",
            )
        },
        name="multiprocess",
    )


def local_executor(config: dict) -> dict:
    """Dagster's multiprocess executor (a process a step, as many at once as CPUs), or with
    ``in_process`` its in-process executor; either with :data:`ON_PARTIAL_FAILURE`."""
    if config[IN_PROCESS]:
        return {"in_process": ON_PARTIAL_FAILURE}
    return {"multiprocess": {"max_concurrent": usable_cpus(), **ON_PARTIAL_FAILURE}}


class DeploymentComponent(dg.Component, dg.Model, dg.Resolvable):
    """The deployment's executor, the shared resources, the store-wide jobs and sensors."""

    executor: Literal["multiprocess", "celery"] = "multiprocess"

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return dg.Definitions(
            resources={
                "zarr_store": ZarrStoreResource(url=dg.EnvVar("ZARRFEED_STORE")),
                "raw": RawFolderResource(root=dg.EnvVar("ZARRFEED_RAW")),
                "build": BuildOptions(),
            },
            executor=executor(self.executor),
            jobs=[datasets_build, store_maintenance],
            sensors=[datasets_automation, dead_runs],
            schedules=[store_maintenance_nightly],
        )
