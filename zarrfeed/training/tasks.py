"""What a training task is, and the tasks of every registered family.

A task names the dataset it reads, its model, its loss and metrics, and its own ``data``
section of the training config; it turns a collated batch (already on the device) into
``(loss, metrics)``, and the trainer owns everything else.  Inputs are converted to float
inside the task, under autocast.  Each family declares its tasks (``Family.tasks``), so
training names no family: :data:`TASK_TYPES` reads them from
:mod:`zarrfeed.families.registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zarrfeed.families import Family
from zarrfeed.training.config import DataSection

# torch, the datasets and the models load when a task first builds or computes, not at
# import: the code location's model assets and the config's validation read only the tasks'
# names, families, versions and metrics, and every run and step process loads the code
# location (torch adds ~1.1 s of CPU to each).
if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from zarrfeed.training.config import TrainConfig

Batch = dict[str, "torch.Tensor"]
# Per-class tables of the evaluation batches: metric name -> class name -> value (None where
# the metric is undefined for that class).
PerClass = dict[str, dict[str, float | None]]
# The check every model asset carries, which the training process reports.
LEARNED = "learned"
LEARNED_DOC = (
    "On fixed evaluation batches, before and after training: the loss fell and the task's "
    "headline metric moved its way and past chance (a classifier's held-out per-finding "
    "AUROC mean above 0.5; IoU or PSNR for others, where a segmenter that finds nothing "
    "stays at IoU 0)."
)


class Task:
    """One task: ``dataset``, ``model`` and ``loss``; ``family`` is the family whose dataset
    manifest it reads (its model asset depends on that dataset)."""

    name: str = ""
    family: Family
    version: str = "2"  # bump when what it trains from the same data changes (2: torchrun)
    # The task's headline metric: the score the field reads for it, on the evaluation
    # batches (a key of what ``loss`` or ``pooled`` returns), which way is better, and the
    # value a model that guesses scores (None: no such floor).  The ``learned`` check and
    # the demo's summary read these and nothing else (:meth:`learned`).
    metric: str = ""
    label: str = ""  # the metric as a person reads it in a summary ("AUROC")
    higher_is_better: bool = True
    chance: float | None = None
    # Which samples the evaluation batches come from: "train" scores the training samples
    # (a task without a held-out split); "held_out" scores only samples never trained on
    # (``data.holdout`` can turn that off for a store too small to hold any out).
    evaluates_on: str = "train"
    # Config sections laid under what a run gives, where the task needs other defaults than
    # the sections' to learn anything in a default run (the sample data, a retrain started by
    # new data); values given in a file, on the command line or in run config still win.
    defaults: dict[str, dict[str, Any]] = {}  # noqa: RUF012 (read only)
    # Its section of the training config (``data``): what it reads from the store.
    Data: type[DataSection] = DataSection
    data_fields: tuple[str, ...] = ()  # the fields of Data, set for each task class
    classes: str = "class"  # what its per-class metrics are per (a finding, say)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.data_fields = tuple(cls.Data.model_fields)

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    @classmethod
    def summary(cls) -> str:
        """The task in one line (its docstring's first sentence)."""
        return " ".join((cls.__doc__ or cls.name).split()).split(". ")[0].rstrip(".")

    def settings(self) -> dict[str, Any]:
        """The config as this task reads it, flat (``train.lr``), where the run writes left
        out."""
        return {
            key: value
            for key, value in self.config.flat().items()
            if key not in ("out", "run_name", "resume", "resume_anyway")
        }

    def dataset(self, split: str | None = None) -> Dataset:
        """The task's dataset: every sample (``split`` None), or only the samples it trains
        on ("train") or is evaluated on ("eval"); a task without a held-out split gives
        every sample to both."""
        raise NotImplementedError

    @classmethod
    def learned(
        cls, before: dict[str, float | None], after: dict[str, float | None]
    ) -> tuple[bool, str]:
        """Whether evaluation ``before`` -> ``after`` training shows that the model learned,
        and why in a few words: the loss fell and the headline metric moved the better way
        and ended past chance.  An undefined metric (None, or missing) has not learned."""
        m, shown = cls.metric, cls.label or cls.metric
        b, a = before.get(m), after.get(m)
        if a is None or b is None:
            return False, f"did not learn: {shown} undefined on the evaluation samples"
        if cls.chance is not None and (
            a <= cls.chance if cls.higher_is_better else a >= cls.chance
        ):
            sign = "≤" if cls.higher_is_better else "≥"
            return False, f"did not learn: {shown} {a:.2f} {sign} {cls.chance:g} (chance)"
        if not (a > b if cls.higher_is_better else a < b):
            return False, f"did not learn: {shown} {b:.2f} -> {a:.2f}"
        lb, la = before.get("loss"), after.get("loss")
        if lb is None or la is None or not la < lb:
            return False, f"did not learn: {shown} {b:.2f} -> {a:.2f}, loss did not fall"
        return True, f"{shown} {b:.2f} -> {a:.2f}"

    def model(self, dataset: Dataset) -> nn.Module:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and the task's metrics, all device tensors: reading a value back waits
        for the device, which the training loop does only at log steps."""
        raise NotImplementedError

    def collate(self, dataset: Dataset) -> Callable[[list[Any]], Any]:
        """The dataset's own collate function (:class:`~.data.protocols.Collating`), else
        torch's default."""
        from torch.utils.data import default_collate

        from zarrfeed.training.data.loader import collate_of

        return collate_of(dataset) or default_collate

    def pooled(
        self, model: nn.Module, batches: Sequence[Batch]
    ) -> tuple[dict[str, float | None], PerClass]:
        """Metrics over all evaluation batches at once (ranks, not per-batch means), as
        scalars and per-class tables; a task without any returns none."""
        return {}, {}


class TaskTypes(Mapping[str, type[Task]]):
    """Task name -> task class of every registered family, read from the registry on each
    use (a family ``ZARRFEED_FAMILIES`` adds is there as soon as it is set)."""

    def _all(self) -> dict[str, type[Task]]:
        from zarrfeed.families.registry import task_types

        return task_types()

    def __getitem__(self, name: str) -> type[Task]:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


TASK_TYPES = TaskTypes()


def model_asset_name(task: str) -> str:
    """The Dagster asset of the model ``task`` trains."""
    return f"{task}_model"


def make_task(config: TrainConfig) -> Task:
    return TASK_TYPES[config.task](config)
