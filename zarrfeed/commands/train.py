"""``zarrfeed train``: the training config's common fields as flags, any other field with
``--set``, a progress bar in a terminal, ``--list-tasks``, and one line when a signal stops
the run.

The flags are made from :class:`zarrfeed.training.config.TrainConfig` itself (type, choices,
description, default), so they cannot drift from the config files' fields.  This module
imports pydantic and YAML only: ``--help`` needs no torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from zarrfeed.errors import ConfigError
from zarrfeed.training.config import TrainConfig

# The fields that get a flag of their own (--batch-size for train.batch_size); every other
# field takes --set SECTION.FIELD=VALUE.
FLAGS = (
    "task", "store", "out", "run_name", "seed", "resume", "resume_anyway",
    "train.steps", "train.batch_size", "train.accumulate", "train.lr", "train.amp",
    "train.device", "dataloader.workers", "data.cache_gb", "data.dataset_version",
)  # fmt: skip


def field_of(path: str) -> tuple[FieldInfo, Any]:
    """The pydantic field at a dotted ``path`` of TrainConfig, and its default."""
    model: type[BaseModel] = TrainConfig
    defaults: Any = TrainConfig.model_construct()  # no validation: the tasks load torch
    *sections, name = path.split(".")
    for section in sections:
        defaults = getattr(defaults, section)
        model = type(defaults)
    return model.model_fields[name], getattr(defaults, name)


def add_parser(sub: Any, options: bool = True) -> None:
    """``options``: the flags, made from the training config (whose package loads torch)
    only when the command line may name ``train``: ``zarrfeed --help`` stays quick."""
    p = sub.add_parser(
        "train", help="train a model on the store (also under torchrun: DDP, one shard per rank)"
    )
    if options:
        add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``zarrfeed train``: a flag given wins over the ``--config`` file."""
    p.add_argument("--config", help="YAML file (sections data, dataloader, train); see configs/")
    p.add_argument("--list-tasks", action="store_true", help="list the tasks and exit")
    for path in FLAGS:
        info, default = field_of(path)
        about = f"{info.description}; " if info.description else ""
        kwargs: dict[str, Any] = {
            "dest": path,
            "default": None,
            "help": f"{about}{path}, default {default!r}",
        }
        kind = info.annotation
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(kind) is Literal:
            kwargs["choices"] = get_args(kind)
        else:
            kwargs["metavar"] = path.split(".")[-1].upper()
            if kind in (int, float):
                kwargs["type"] = kind
        p.add_argument("--" + path.split(".")[-1].replace("_", "-"), **kwargs)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other field, e.g. --set train.weight_decay=0.01 (VALUE read as YAML)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags and ``--set`` pairs given, as nested sections."""
    pairs = [(path, getattr(args, path)) for path in FLAGS if getattr(args, path) is not None]
    for item in args.set:
        path, sep, text = item.partition("=")
        if not sep or not path:
            raise ConfigError(f"--set {item}: expected FIELD=VALUE, e.g. train.lr=0.001")
        try:
            pairs.append((path.strip(), yaml.safe_load(text)))
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item}: the value is not YAML ({exc})") from None
    nested: dict[str, Any] = {}
    for path, value in pairs:
        *sections, name = path.split(".")
        target = nested
        for section in sections:
            target = target.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(f"--set {path}: {section} is a field, not a section")
        target[name] = value
    return nested


def list_tasks() -> str:
    from zarrfeed.training.tasks import TASK_TYPES

    width = max(map(len, TASK_TYPES))
    return "\n".join(f"{name:{width}}  {t.summary()}" for name, t in TASK_TYPES.items())


class Bar:
    """A bar of optimiser steps on stderr (rich, as every zarrfeed display), made at the
    first step (the loader's set-up lines print before it); the trainer's log lines print
    above it."""

    def __init__(self) -> None:
        self.progress: Any = None
        self.task: Any = None

    def log(self, line: str) -> None:
        if self.progress is None:
            print(line, flush=True)
        else:
            self.progress.console.print(line, markup=False, highlight=False)

    def __call__(self, step: int, total: int) -> None:
        if self.progress is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn("steps"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=sys.stderr),
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=total, completed=step)
        self.progress.update(self.task, completed=step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def run(args: argparse.Namespace) -> int:
    if args.list_tasks:
        print(list_tasks())
        return 0
    config = TrainConfig.load(args.config, **overrides(args))
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0
    from zarrfeed.training.runtime import DistEnv
    from zarrfeed.training.stopping import TrainingStopped
    from zarrfeed.training.trainer import train

    main_rank = DistEnv.from_environ().main
    bar = Bar() if main_rank and sys.stderr.isatty() else None
    try:
        result = train(config, log=bar.log if bar else print, progress=bar)
    except TrainingStopped as exc:
        if bar:
            bar.close()  # the message goes under the bar, not into it
        print(f"zarrfeed train: {exc}", file=sys.stderr)
        return 128 + exc.signum
    finally:
        if bar:
            bar.close()
    if main_rank:  # torchrun runs this on every rank
        folder = Path(result.checkpoint).parent
        print(
            f"checkpoint {result.checkpoint}; metrics {folder / 'metrics.json'}; "
            f"tensorboard --logdir {folder}"
        )
    return 0
