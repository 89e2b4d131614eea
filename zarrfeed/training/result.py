"""What a training run leaves: its curve, timings, evaluations and checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zarrfeed.training.tasks import PerClass


@dataclass
class TrainResult:
    """What a run leaves: the curve, timings, evaluation before/after and the checkpoint."""

    task: str
    step: int
    history: dict[str, list[float]]
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    samples_per_s: float
    data_wait_share: float
    checkpoint: str
    data: dict[str, Any]
    config: dict[str, Any]
    loader: list[str] = field(default_factory=list)
    resumed_from: int = 0
    peak_memory_mb: float = 0.0
    # per-class tables of the evaluation batches (metric -> class -> value; the CT-RATE
    # classifier's per-finding AUROC), after and before training
    per_class: PerClass = field(default_factory=dict)
    per_class_before: PerClass = field(default_factory=dict)
    stopped_by: str = ""  # the signal that ended the run early, if one did

    def summary(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "step": self.step,
            "final_loss": self.history["loss"][-1] if self.history["loss"] else None,
            "eval_before": self.eval_before,
            "eval_after": self.eval_after,
            "samples_per_s": round(self.samples_per_s, 2),
            "data_wait_share": round(self.data_wait_share, 4),
            "resumed_from": self.resumed_from,
            "peak_memory_mb": round(self.peak_memory_mb, 1),
            "checkpoint": self.checkpoint,
            "data": self.data,
            # the declared augmentation, every operation's parameters (None: off)
            "augment": self.config.get("data", {}).get("augment"),
            "per_class": self.per_class,
            "per_class_before": self.per_class_before,
            **({"stopped_by": self.stopped_by} if self.stopped_by else {}),
        }
