"""Training as a Dagster component: one model asset per task, the train job, and the
automation that retrains a model when its dataset has new data."""

from __future__ import annotations

import dagster as dg

from zarrfeed.jobs.automation import training_automation
from zarrfeed.jobs.build import train
from zarrfeed.resources import ModelsResource


class TrainingComponent(dg.Component, dg.Model, dg.Resolvable):
    """The models: ``tasks`` to train (default: every task), ``nproc_per_node`` training
    processes per run (one per GPU, or a few CPU ranks)."""

    tasks: list[str] | None = None
    nproc_per_node: int = 1

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        # The tasks and the trainer load torch: only when the definitions are built.
        from zarrfeed.assets.torchrun import TorchrunResource
        from zarrfeed.assets.training import model_asset
        from zarrfeed.training.tasks import TASK_TYPES

        tasks = self.tasks if self.tasks is not None else list(TASK_TYPES)
        unknown = [t for t in tasks if t not in TASK_TYPES]
        if unknown:
            raise ValueError(f"tasks: no task {unknown}; the tasks are {', '.join(TASK_TYPES)}")
        return dg.Definitions(
            assets=[model_asset(task) for task in tasks],
            jobs=[train],
            sensors=[training_automation],
            resources={
                "models": ModelsResource(root=dg.EnvVar("ZARRFEED_MODELS")),
                "torchrun": TorchrunResource(nproc_per_node=self.nproc_per_node),
            },
        )
