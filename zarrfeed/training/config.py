"""The training configuration: one typed model, read from YAML by ``zarrfeed train --config``
and turned into Dagster run config by :mod:`zarrfeed.assets.training` (no Dagster here).

Sections follow the spike-deblurring training files users had (``data``, ``dataloader``,
``train``); every default runs on
the built-in sample data.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from zarrfeed import defaults
from zarrfeed.errors import ConfigError
from zarrfeed.training.augment import AugmentConfig


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataSection(Section):
    """What the task reads from the store: the fields every task has; each task's own
    section (``Task.Data``) adds its fields."""

    cache_gb: float = Field(
        1.0, description="GB of RAM for decoded arrays, one copy shared by all workers"
    )
    eval_batches: int = Field(4, description="fixed batches scored before and after training")
    dataset_version: str | None = Field(
        None,
        description="the dataset version to read (`zarrfeed datasets list`); default: the "
        "current one, recorded in the run",
    )
    augment: AugmentConfig | None = Field(
        None,
        description="batched, seeded augmentation of the training batches: on the training "
        "device after the device tier cuts them, else per sample in the loader workers; "
        "without a recipe it takes the task's own; default: off",
    )
    # The recipe ``augment`` takes when it names none (a family's, ``Family.augment``);
    # None: the task declares none, and ``augment`` is refused.
    augment_recipe: ClassVar[str | None] = "none"

    @field_validator("augment", mode="before")
    @classmethod
    def _own_recipe(cls, value: Any) -> Any:
        if value is None:
            return None
        if cls.augment_recipe is None:
            raise ValueError(
                f"{cls.__name__} declares no augmentation recipe (augment_recipe None): "
                "this task's batches take no augmentation"
            )
        if isinstance(value, Mapping) and "recipe" not in value:
            return {"recipe": cls.augment_recipe, **value}
        return value


class LoaderConfig(Section):
    """DataLoader sizing (``zarrfeed.training.data.plan.plan_loader``) and order."""

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
        description="patch datasets: use the training device as a cache tier and cut batches there "
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


class TrainConfig(Section):
    """One training run: task, where the data and checkpoints live, and the three sections.

    Every task has a config model of its own, this one with ``task`` fixed to its name and
    ``data`` its section (:func:`config_model`), and the training config is their union,
    discriminated on ``task``: :meth:`model_validate` and :meth:`load` pick the task's model
    (the first task when none is named), so a field another task reads is an unknown key.
    """

    task: str = Field(
        default_factory=lambda: next(iter(task_types())),
        description="what to train (`zarrfeed train --list-tasks`); default: the first task",
    )
    store: str = Field(defaults.STORE, description="Zarr store URL")
    out: str = Field(defaults.MODELS, description="folder of the checkpoints")
    run_name: str = Field("", description="checkpoints go to <out>/<task>/<run_name>/")
    seed: int = 0
    resume: bool = Field(
        True,
        description="continue the checkpoint in the run folder when it is of the same run "
        "(see resume_anyway); false, or another run's checkpoint there: a new folder "
        "<run_name>-2, -3, ...",
    )
    resume_anyway: bool = Field(
        False, description="continue the run folder's checkpoint even when its config differs"
    )
    data: DataSection = DataSection()
    dataloader: LoaderConfig = LoaderConfig()
    train: TrainSection = TrainSection()

    def __init__(self, /, **values: Any) -> None:
        if type(self) is TrainConfig:
            raise TypeError(
                "TrainConfig is the union of every task's config: make one with "
                "TrainConfig.model_validate({...}) or TrainConfig.load(), which pick the "
                "task's own model"
            )
        super().__init__(**values)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> TrainConfig:
        """``obj`` validated by its task's config model (the union's member its ``task``
        names; the first task when it names none)."""
        if cls is not TrainConfig:
            return super().model_validate(obj, **kwargs)
        if isinstance(obj, dict) and not obj.get("task"):
            obj = {**obj, "task": next(iter(task_types()))}
        return TypeAdapter(config_union()).validate_python(obj, **kwargs)

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, values: Any) -> Any:
        """Lay the task's own defaults (``Task.defaults``) under the given sections."""
        if not isinstance(values, dict):
            return values
        task = task_types().get(values.get("task") or cls.model_fields["task"].default)
        merged = dict(values)
        for section, own in (task.defaults if task else {}).items():
            given = merged.get(section, {})
            if isinstance(given, dict):
                merged[section] = {**own, **given}
        return merged

    @property
    def run_dir(self) -> Path:
        return Path(self.out) / self.task / self.run_name

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> TrainConfig:
        """The defaults, a YAML file over them, and ``overrides`` over both (section by
        section: ``train={"lr": 0.1}`` keeps the file's other train fields); errors name the
        file, the line and the offending key, and an unknown key the valid ones."""
        raw: Any = {}
        where, text = str(path) if path else "training config", ""
        if path is not None:
            try:
                text = Path(path).read_text()
                raw = yaml.safe_load(text) or {}
            except OSError as exc:
                raise ConfigError(f"cannot read training config {path}: {exc}") from exc
            except yaml.MarkedYAMLError as exc:
                raise ConfigError(f"{path}: {yaml_problem(exc)}") from None
            if not isinstance(raw, dict):
                raise ConfigError(
                    f"{path}: expected a mapping of sections, found {type(raw).__name__}"
                )
        values = merged(raw, overrides)
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            lines = key_lines(text) if text else {}
            given = set(flatten(overrides))
            models = {config_model(t).model_fields["task"].default: config_model(t)
                      for t in task_types().values()}  # fmt: skip
            model = models.get(values.get("task") or next(iter(models)), cls)
            problems = "; ".join(validation_problem(model, e, lines, given) for e in exc.errors())
            raise ConfigError(f"{where}: {problems}") from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """The config as ``{"train.lr": 0.002, ...}``."""
        return flatten(self.model_dump())


def task_types() -> dict[str, Any]:
    """Task name -> class, of every registered family (:mod:`zarrfeed.families.registry`)."""
    from zarrfeed.families.registry import task_types as registered

    return registered()


@functools.cache
def config_model(task: type) -> type[TrainConfig]:
    """The config model of ``task`` (a task class): ``task`` fixed to its name, ``data``
    its own section (``task.Data``).  One model per task class, so that configs of the same
    task are of one type."""
    return create_model(
        f"{task.__name__}Config",
        __base__=TrainConfig,
        __doc__=f"The training config of {task.name}: {task.summary()}.",
        task=(
            Literal[task.name],
            Field(task.name, description=TrainConfig.model_fields["task"].description),
        ),
        data=(task.Data, Field(default_factory=task.Data)),
    )


def config_union() -> Any:
    """Every registered task's config model, discriminated on ``task``."""
    models = tuple(config_model(t) for t in task_types().values())
    if len(models) == 1:  # a union of one is its member
        return models[0]
    return Annotated[Union[models], Field(discriminator="task")]  # noqa: UP007 (built at run time)


def yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    """A YAML syntax error as ``line L, column C: problem`` (PyYAML names the stream, which
    is ``<unicode string>`` for text read first)."""
    mark, start = exc.problem_mark or exc.context_mark, exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    context = f" ({exc.context}" if exc.context else ""
    if context and start is not None and start.line != mark.line:
        context += f" that starts at line {start.line + 1}"
    context += ")" if context else ""
    return f"{where}{exc.problem or 'invalid YAML'}{context}"


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """The 1-based line of every mapping key in a YAML document, by its path of keys."""
    found: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = (*prefix, str(key.value))
                found[path] = key.start_mark.line + 1
                walk(value, path)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return found
    if root is not None:
        walk(root, ())
    return found


def valid_keys(model: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    """The field names of the section ``loc`` points into (the top level for a one-part
    ``loc``)."""
    for part in loc[:-1]:
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def validation_problem(
    model: type[BaseModel], error: Any, lines: dict[tuple[str, ...], int], given: set[str]
) -> str:
    """One pydantic error as ``line L: train.stepz: unknown key (valid keys: ...)``; the
    union's tag (the task's name, which pydantic puts first) is left out of the key."""
    loc = tuple(str(p) for p in error["loc"])
    if error["type"] == "union_tag_invalid":
        tasks = ", ".join(task_types())
        loc, error = (
            ("task",),
            {**error, "msg": f"no task {error['ctx']['tag']!r}; the tasks are {tasks}"},
        )
    elif loc and loc[0] == model.model_fields["task"].default:
        loc = loc[1:]
    name = ".".join(loc)
    line = None if name in given else lines.get(loc)
    where = f"line {line}: " if line else ""
    if error["type"] == "extra_forbidden":
        return f"{where}{name}: unknown key (valid keys: {', '.join(valid_keys(model, loc))})"
    return f"{where}{name}: {error['msg']}"


# What a checkpoint's run is NOT defined by: how long it runs, how often it logs and saves,
# where it writes, the machine and loader processes, and speed settings that change neither
# the batches nor the arithmetic.  Every other field (task, data, batch, accumulation,
# optimiser, precision, model, seed, sampler, cache_gb, which picks the sampler in "auto")
# must match for a run to continue a checkpoint.  The store URL is compared as the data it
# holds (the dataset manifest's hash), so the same store reached by another path still resumes.
# The device tier and the memory of the machine pick the epoch order (a whole shuffle or a
# block shuffle, and its block size): the checkpoint records that order itself, and a resumed
# run takes it up or is another run (Trainer._order_differs).
RESUME_IGNORES = frozenset(
    {
        "store", "out", "run_name", "resume", "resume_anyway",
        "train.steps", "train.log_every", "train.checkpoint_every", "train.release_every",
        "train.device", "train.grad_checkpointing",
        "dataloader.workers", "dataloader.context", "dataloader.preload",
        "dataloader.device_cache",
    }
)  # fmt: skip


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base``, mappings merged key by key."""
    out = dict(base)
    for key, value in over.items():
        inner = out.get(key)
        both = isinstance(value, dict) and isinstance(inner, dict)
        out[key] = merged(inner, value) if both else value
    return out


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` as ``{"train.lr": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def run_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What makes ``current`` (a config dump, plus its ``data`` fingerprint under
    ``"data_fingerprint"``) another run than ``saved``: ``train.batch_size: 4 -> 8`` lines,
    the fields in ``RESUME_IGNORES`` aside."""
    old, new = flatten(saved), flatten(current)
    return [
        f"{key}: {old.get(key, '(absent)')} -> {new.get(key, '(absent)')}"
        for key in sorted(old.keys() | new.keys())
        if key not in RESUME_IGNORES and old.get(key) != new.get(key)
    ]
