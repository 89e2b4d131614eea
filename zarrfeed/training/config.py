"""The training configuration: one typed model, read from YAML by ``zarrfeed train --config``
and turned into Dagster run config by :mod:`zarrfeed.assets.training` (no Dagster here).

Sections follow the spike-deblurring training files users had (``data``, ``dataloader``,
``train``); every default runs on
the built-in sample data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from zarrfeed.errors import ConfigError

Task = Literal["ct_classifier", "sparse_autoencoder", "spike_deblur", "defect_segmentation"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(Section):
    """What the task reads from the store (fields a task does not use are ignored)."""

    window: str = Field("lung", description="CT window (ct_classifier, sparse_autoencoder)")
    patch: bool = Field(True, description="CT patches from the patch index, else whole volumes")
    patch_sampler: Literal["stored", "uniform", "foreground"] = Field(
        "stored",
        description="where CT patches are cut in their volume: the stored patch index "
        "(mostly body), anywhere (uniform), or centred on the stored occupancy of the window "
        "(foreground)",
    )
    max_points: int = Field(
        1 << 20, description="points per scan before rebuilding the occupancy grid"
    )
    clip_len: int = Field(3, description="spike clip length in samples")
    crop: list[int] = Field([64, 64], description="spike crop (H, W)")
    voxels: Literal["stored", "realtime"] = Field("stored", description="spike voxel source")
    defects: bool = Field(True, description="synthesise local defects on image patches")
    cache_gb: float = Field(
        1.0, description="GB of RAM for decoded arrays, one copy shared by all workers"
    )
    eval_batches: int = Field(4, description="fixed batches scored before and after training")


class LoaderConfig(Section):
    """DataLoader sizing (``zarrfeed.training.data.loader.plan_loader``) and order."""

    workers: str = Field(
        "auto", description="loader processes in all: 'auto', 'cpu*0.9' or an integer"
    )
    context: Literal["auto", "fork", "forkserver", "spawn"] = Field(
        "auto",
        description="worker start method; auto: forkserver, or fork where forkserver workers "
        "would re-run the calling script or miss what it defines",
    )
    preload: Literal["auto", "always", "never"] = "auto"
    sampler: Literal["auto", "block", "random"] = Field(
        "auto",
        description="epoch order: block shuffle (partitions in blocks that fit the cache, the "
        "next block prefetched) or a shuffle of the whole dataset; auto: block when the "
        "dataset's decoded arrays exceed data.cache_gb",
    )
    device_cache: Literal["auto", "on", "off"] = Field(
        "auto",
        description="CT patches: use the training device as a cache tier and cut batches there "
        "(the volumes when they fit its budget, else a pool of cache-unit slots within it); "
        "auto: on CUDA devices only",
    )
    device_cache_gb: float | None = Field(
        None,
        gt=0,
        description="GiB of device memory the device cache may take (default: a quarter of "
        "the free device memory)",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _count_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) else value


class TrainSection(Section):
    """The loop: steps, batch, optimiser, precision, checkpoints."""

    steps: int = Field(
        40, ge=1, description="optimiser steps in all (a resumed run continues to it)"
    )
    batch_size: int = Field(4, ge=1)
    accumulate: int = Field(1, ge=1, description="micro-batches per optimiser step")
    lr: float = 2e-3
    weight_decay: float = 0.0
    max_grad_norm: float = Field(1.0, description="0 disables clipping")
    amp: Literal["auto", "off", "bf16", "fp16"] = Field(
        "auto",
        description="auto: bf16 on GPUs that have it, fp16 + scaler on other GPUs, fp32 on the "
        "CPU; bf16 asks for CPU bf16 autocast",
    )
    grad_checkpointing: bool = False
    release_every: int = Field(0, description="empty the CUDA cache + gc every N steps (0: off)")
    log_every: int = 5
    checkpoint_every: int = Field(20, description="steps between checkpoints (the last always)")
    device: str = Field("auto", description="auto: cuda when present, else cpu")
    width: int = Field(16, description="channels of the first model layer")


# Where a task needs other defaults than the sections' to learn anything in a default run
# (the sample data, a retrain started by new data): a segmenter of defects that cover ~0.05 %
# of a patch finds none before ~60 steps of 8 patches (its IoU stays 0 at 40 steps of 4).
# Values given in a file, on the command line or in run config still win.
TASK_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "defect_segmentation": {"train": {"steps": 100, "batch_size": 8, "lr": 0.003}},
}


class TrainConfig(Section):
    """One training run: task, where the data and checkpoints live, and the three sections."""

    task: Task = "ct_classifier"
    store: str = Field("data/zarrfeed.zarr", description="Zarr store URL")
    out: str = Field("data/models", description="folder of the checkpoints")
    run_name: str = Field("", description="checkpoints go to <out>/<task>/<run_name>/")
    seed: int = 0
    resume: bool = Field(True, description="continue from <out>/<task>/last.pt when present")
    data: DataConfig = DataConfig()
    dataloader: LoaderConfig = LoaderConfig()
    train: TrainSection = TrainSection()

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, values: Any) -> Any:
        """Lay the task's own defaults (``TASK_DEFAULTS``) under the given sections."""
        if not isinstance(values, dict):
            return values
        task = values.get("task", cls.model_fields["task"].default)
        merged = dict(values)
        for section, defaults in TASK_DEFAULTS.get(task, {}).items():
            given = merged.get(section, {})
            if isinstance(given, dict):
                merged[section] = {**defaults, **given}
        return merged

    @property
    def run_dir(self) -> Path:
        return Path(self.out) / self.task / self.run_name

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> TrainConfig:
        """The defaults, a YAML file over them, and ``overrides`` over both; errors name the
        file and the offending key."""
        raw: Any = {}
        where = str(path) if path else "training config"
        if path is not None:
            try:
                raw = yaml.safe_load(Path(path).read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise ConfigError(f"cannot read training config {path}: {exc}") from exc
            if not isinstance(raw, dict):
                raise ConfigError(
                    f"{path}: expected a mapping of sections, found {type(raw).__name__}"
                )
        try:
            return cls.model_validate({**raw, **overrides})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"{where}: {problems}") from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)
