"""``torchrun --nproc-per-node=N -m zarrfeed.pipes_training --config run.yaml``: the training
process the model assets launch through Dagster Pipes.

It trains exactly as ``zarrfeed train`` does (:func:`zarrfeed.training.trainer.train`, every
rank), and when Dagster launched it, rank 0 reports back through Pipes: the trainer's log
lines, the materialisation with its metadata and the ``learned`` check.  Outside Dagster
(no Pipes variables in the environment) the same command trains and reports nothing, so a
run can be repeated or resumed by hand from the YAML the asset leaves in its run folder.

It imports ``dagster_pipes`` (one dependency-free module), never ``dagster``: a training
machine needs neither Dagster nor the code location.  That is why it lives here and not in
``zarrfeed.training`` (which imports no Dagster package at all) nor in ``zarrfeed.assets``
(whose package import loads Dagster).
"""

from __future__ import annotations

import argparse
import base64
import sys
from collections.abc import Sequence
from typing import Any

from dagster_pipes import PipesContext, PipesEnvVarParamsLoader, open_dagster_pipes
from torch.distributed.elastic.multiprocessing.errors import record

from zarrfeed.training.config import TrainConfig
from zarrfeed.training.report import loss_curve_png
from zarrfeed.training.tasks import TASK_TYPES
from zarrfeed.training.trainer import DistEnv, TrainResult, train

LEARNED = "learned"
LEARNED_DOC = (
    "On fixed evaluation batches, before and after training: the loss fell and the task's "
    "metric rose (accuracy, IoU or PSNR; a segmenter that finds nothing stays at IoU 0)."
)


def result_metadata(result: TrainResult, trained_on: dict[str, Any]) -> dict[str, Any]:
    """What a person checks on a trained model, as Pipes metadata: metrics, curve, speed,
    config and the data it trained on (``trained_on`` adds the orchestrator's data versions)."""
    losses = result.history["loss"]
    png = base64.b64encode(loss_curve_png(losses, title=result.task)).decode()
    title = (
        f"**{result.task}: training loss {losses[0]:.4g} → {losses[-1]:.4g} over "
        f"{len(losses)} steps**"
    )
    return {
        "dagster/uri": {"raw_value": result.checkpoint, "type": "path"},
        "steps": {"raw_value": result.step, "type": "int"},
        "resumed_from_step": {"raw_value": result.resumed_from, "type": "int"},
        "final_loss": {"raw_value": round(losses[-1], 4), "type": "float"},
        **{
            f"eval_{k}": {"raw_value": round(v, 4), "type": "float"}
            for k, v in result.eval_after.items()
        },
        **{
            f"eval_{k}_before": {"raw_value": round(v, 4), "type": "float"}
            for k, v in result.eval_before.items()
        },
        "loss_curve": {
            "raw_value": f"{title}\n\n![loss curve](data:image/png;base64,{png})",
            "type": "md",
        },
        "data_wait_share": {"raw_value": round(result.data_wait_share, 4), "type": "float"},
        "samples_per_s": {"raw_value": round(result.samples_per_s, 2), "type": "float"},
        **(
            {"peak_gpu_memory_mb": {"raw_value": round(result.peak_memory_mb, 1), "type": "float"}}
            if result.peak_memory_mb
            else {}  # on the CPU there is none to report, and 0 would read as a measurement
        ),
        "loader": {"raw_value": "\n".join(f"- {r}" for r in result.loader), "type": "md"},
        "config": {"raw_value": result.config, "type": "json"},
        "trained_on": {"raw_value": {**result.data, **trained_on}, "type": "json"},
    }


def report(pipes: PipesContext, result: TrainResult) -> None:
    """Rank 0's report: the materialisation, then the warning check that the model learned:
    the loss fell and the task's own metric rose."""
    trained_on = pipes.extras.get("trained_on", {})
    pipes.report_asset_materialization(metadata=result_metadata(result, trained_on))
    metric = TASK_TYPES[result.task].metric
    before, after = result.eval_before, result.eval_after
    pipes.report_asset_check(
        LEARNED,
        passed=after["loss"] < before["loss"] and after[metric] > before[metric],
        severity="WARN",
        metadata={
            f"{name}_{when}": round(values[name], 4)
            for name in ("loss", metric)
            for when, values in (("before", before), ("after", after))
        },
    )


@record  # a rank's exception goes to torchrun's error file: the asset quotes it on failure
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zarrfeed.pipes_training", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML file of a TrainConfig")
    config = TrainConfig.load(parser.parse_args(argv).config)
    launched_by_dagster = PipesEnvVarParamsLoader().is_dagster_pipes_process()
    if not (launched_by_dagster and DistEnv.from_environ().main):
        train(config)  # the trainer logs and writes on rank 0 only
        return 0
    with open_dagster_pipes() as pipes:

        def log(line: str) -> None:
            print(line, flush=True)  # also in the rank's log file and the step's stdout
            pipes.log.info(line)

        report(pipes, train(config, log=log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
