"""Training without Dagster, in two rooms: :mod:`zarrfeed.training.data` feeds it (cached
Datasets, samplers, self-sizing DataLoaders); the config, tasks, models and trainer learn."""

from zarrfeed.training import data
from zarrfeed.training.config import TrainConfig
from zarrfeed.training.data import *  # noqa: F403 - the data room's public names, re-exported
from zarrfeed.training.trainer import Trainer, TrainResult, train

__all__ = [*data.__all__, "TrainConfig", "TrainResult", "Trainer", "train"]
