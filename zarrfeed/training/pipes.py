"""``torchrun --nproc-per-node=N -m zarrfeed.training.pipes --config run.yaml``: the training
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
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from dagster_pipes import PipesContext, PipesEnvVarParamsLoader, open_dagster_pipes
from torch.distributed.elastic.multiprocessing.errors import record

from zarrfeed.training.config import TrainConfig
from zarrfeed.training.report import loss_curve_png
from zarrfeed.training.tasks import LEARNED, TASK_TYPES
from zarrfeed.training.trainer import DistEnv, TrainResult, train

COUNTS = ("positives", "negatives")  # per-class tables that count samples, not score them


def table(columns: dict[str, str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Pipes metadata of a table: ``columns`` maps each column's name to its Dagster type
    (string, int, float, bool)."""
    schema = [{"name": name, "type": kind} for name, kind in columns.items()]
    return {"raw_value": {"records": rows, "schema": schema}, "type": "table"}


def shown(value: Any) -> str:
    """A setting's value as text in a table cell (lists and numbers as YAML writes them)."""
    return value if isinstance(value, str) else json.dumps(value)


def settings_table(result: TrainResult) -> dict[str, Any]:
    """The run's settings as its task reads them (no other task's data fields), with each
    one's default for the task, so what was changed stands out."""
    task = TASK_TYPES[result.task]
    config = TrainConfig.model_validate(result.config)
    defaults = task(TrainConfig.model_validate({"task": result.task})).settings()
    rows = [
        {"setting": key, "value": shown(value), "default": shown(defaults.get(key)),
         "changed": value != defaults.get(key)}
        for key, value in task(config).settings().items()
    ]  # fmt: skip
    return table({"setting": "string", "value": "string", "default": "string", "changed": "bool"},
                 rows)  # fmt: skip


def per_class_label(result: TrainResult) -> str:
    """The per-class table's metadata label (``auroc_per_finding``: metrics, then the task's
    ``classes``)."""
    metrics = [m for m in result.per_class if m not in COUNTS]
    return f"{'_'.join(metrics)}_per_{TASK_TYPES[result.task].classes}"


def per_class_table(result: TrainResult) -> dict[str, Any]:
    """Per-class evaluation values before and after training (a multi-label classifier's
    per-finding AUROC, with the positives and negatives behind each): one row per class,
    empty cells where a value is undefined (one class only among the evaluation samples)."""
    after, before = result.per_class, result.per_class_before
    metrics = [m for m in after if m not in COUNTS]
    classes = TASK_TYPES[result.task].classes
    columns = {classes: "string"}
    for m in metrics:
        columns |= {f"{m}_before": "float", m: "float"}
    columns |= {k: "int" for k in COUNTS if k in after}
    names = next(iter(after.values()), {})
    rows = []
    for name in names:
        row: dict[str, Any] = {classes: name}
        for m in metrics:
            row[f"{m}_before"] = _rounded(before.get(m, {}).get(name))
            row[m] = _rounded(after[m].get(name))
        row |= {k: after[k][name] for k in COUNTS if k in after}
        rows.append(row)
    return table(columns, rows)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def loss_table(result: TrainResult, window: int) -> dict[str, Any]:
    """The loss curve as numbers: the mean loss and samples/s of every ``window`` steps."""
    h, rows = result.history, []
    for end in range(window, len(h["loss"]) + window, window):
        part = slice(end - window, min(end, len(h["loss"])))
        seconds = sum(h["data_time"][part]) + sum(h["step_time"][part])
        rows.append({
            "step": min(end, len(h["loss"])),
            "loss": round(float(np.mean(h["loss"][part])), 5),
            "samples_per_s": round(sum(h["samples"][part]) / seconds, 2) if seconds else 0.0,
        })  # fmt: skip
    return table({"step": "int", "loss": "float", "samples_per_s": "float"}, rows)


def trained_on_table(result: TrainResult, trained_on: dict[str, Any]) -> dict[str, Any]:
    """What the model learned from: dataset, manifest hash, partitions and the orchestrator's
    data version of each upstream asset."""
    rows = [{"what": k, "value": str(v)} for k, v in result.data.items()]
    for asset, version in trained_on.get("data_versions", {}).items():
        rows.append({"what": f"data version of {asset}", "value": str(version)})
    return table({"what": "string", "value": "string"}, rows)


def result_metadata(result: TrainResult, trained_on: dict[str, Any]) -> dict[str, Any]:
    """What a person checks on a trained model, as Pipes metadata: the checkpoint, metrics
    (per class too), the loss curve as numbers Dagster plots and as a picture, speed, the
    task's own settings and the data it trained on (``trained_on`` adds the orchestrator's
    data versions)."""
    losses = result.history["loss"]
    png = base64.b64encode(loss_curve_png(losses, title=result.task)).decode()
    title = (
        f"**{result.task}: training loss {losses[0]:.4g} → {losses[-1]:.4g} over "
        f"{len(losses)} steps**"
    )
    window = max(1, TrainConfig.model_validate(result.config).train.log_every)
    return {
        "dagster/uri": {"raw_value": result.checkpoint, "type": "path"},
        "checkpoint": {"raw_value": result.checkpoint, "type": "path"},
        "tensorboard": {
            "raw_value": f"tensorboard --logdir {Path(result.checkpoint).parent}",
            "type": "text",
        },
        "steps": {"raw_value": result.step, "type": "int"},
        "resumed_from_step": {"raw_value": result.resumed_from, "type": "int"},
        "final_loss": {"raw_value": round(losses[-1], 4), "type": "float"},
        # plotted across runs: the loss where the run ended, steadier than its last step
        "final_loss_mean": {
            "raw_value": round(float(np.mean(losses[-window:])), 4),
            "type": "float",
        },
        **{
            f"eval_{k}": {"raw_value": round(v, 4), "type": "float"}
            for k, v in result.eval_after.items()
            if v is not None
        },
        **{
            f"eval_{k}_before": {"raw_value": round(v, 4), "type": "float"}
            for k, v in result.eval_before.items()
            if v is not None
        },
        **({per_class_label(result): per_class_table(result)} if result.per_class else {}),
        "loss_by_step": loss_table(result, window),
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
        "settings": settings_table(result),
        "trained_on": trained_on_table(result, trained_on),
    }


def learned_check(result: TrainResult) -> dict[str, Any]:
    """The ``learned`` check of a run, as :meth:`PipesContext.report_asset_check` takes it:
    passed where the loss fell and the task's headline metric moved its way past chance
    (:meth:`Task.learned`), with the values behind it and the verdict in words."""
    task = TASK_TYPES[result.task]
    before, after = result.eval_before, result.eval_after
    passed, verdict = task.learned(before, after)
    values = {
        f"{name}_{when}": round(v, 4)
        for name in ("loss", task.metric)
        for when, found in (("before", before), ("after", after))
        if (v := found.get(name)) is not None
    }
    return {"passed": passed, "metadata": {**values, "verdict": verdict}}


def report(pipes: PipesContext, result: TrainResult) -> None:
    """Rank 0's report: the materialisation, then the warning check that the model learned
    (:func:`learned_check`)."""
    trained_on = pipes.extras.get("trained_on", {})
    pipes.report_asset_materialization(metadata=result_metadata(result, trained_on))
    pipes.report_asset_check(LEARNED, severity="WARN", **learned_check(result))


@record  # a rank's exception goes to torchrun's error file: the asset quotes it on failure
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zarrfeed.training.pipes", description=__doc__)
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
