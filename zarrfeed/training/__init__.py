"""Training without Dagster, in two rooms: :mod:`zarrfeed.training.data` feeds it (cached
Datasets, samplers, self-sizing DataLoaders); the config, tasks, model blocks and trainer
learn.

The public names load their module on first use, so that reading a training config
(:mod:`zarrfeed.training.config`, which the CLI's parser does) does not import torch, whose
import alone takes ~1.7 s on two cores."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zarrfeed.training.config import TrainConfig as TrainConfig
    from zarrfeed.training.data import *  # noqa: F403
    from zarrfeed.training.result import TrainResult as TrainResult
    from zarrfeed.training.trainer import Trainer as Trainer
    from zarrfeed.training.trainer import train as train

_HOMES = {
    "TrainConfig": "config",
    "Trainer": "trainer",
    "TrainResult": "result",
    "train": "trainer",
}


def __getattr__(name: str) -> Any:
    if name == "__all__":
        from zarrfeed.training import data

        return [*data.__all__, *_HOMES]
    module = importlib.import_module(f"zarrfeed.training.{_HOMES.get(name, 'data')}")
    if name == "data":
        return module
    if hasattr(module, name):
        return getattr(module, name)
    raise AttributeError(f"module 'zarrfeed.training' has no attribute {name!r}")
