"""DataLoaders that size themselves: :func:`make_loader` gathers the facts of the dataset
and the machine, asks the loading plan (:func:`~zarrfeed.training.data.plan.plan_loading`)
for workers, prefetch, pinning, the epoch order and the cache's preload, and builds what it
says; the choice is logged with its reasons."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

from zarrfeed.training.data.epochs import EpochIndexed, EpochKeys, epoch_of
from zarrfeed.training.data.facts import Budgets, data_facts, machine_facts, world_facts
from zarrfeed.training.data.plan import LoaderPlan, LoadingPlan, plan_loading, preloaded, started
from zarrfeed.training.data.protocols import Collating, Ordering, StoreBacked
from zarrfeed.training.data.sampler import build_order
from zarrfeed.training.data.start import start_method


def collate_of(dataset: Dataset, collate_fn: Callable | None = None) -> Callable | None:
    """``collate_fn``, else the dataset's own (None: torch's default)."""
    if collate_fn is not None:
        return collate_fn
    return dataset.collate if isinstance(dataset, Collating) else None


def run_preload(dataset: Dataset, plan: LoadingPlan) -> None:
    """Preload ``dataset``'s cache when ``plan`` says so, and record how long it took."""
    if plan.preload and isinstance(dataset, StoreBacked):
        t0 = time.perf_counter()
        dataset.preload()
        preloaded(plan, time.perf_counter() - t0)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    workers: int | str = "auto",
    shuffle: bool = True,
    preload: bool | str = "auto",
    collate_fn: Callable | None = None,
    sampler: Sampler | None = None,
    drop_last: bool = False,
    train: bool = True,
    context: str = "auto",
    log: Callable[[str], None] | None = print,
    name: str = "train",
    order: str = "auto",
    seed: int = 0,
    batch_sampler: Sampler | None = None,
    pin_memory: bool | None = None,
    ring: bool = False,
) -> tuple[DataLoader, LoaderPlan]:
    """A DataLoader over ``dataset`` with a planned configuration.

    When the dataset fits its cache budget it is preloaded (``preload="auto"``) and shuffled
    whole; when it does not, a :class:`~zarrfeed.training.data.sampler.BlockSampler` keeps
    the working set inside the cache (``order``: "auto", "block" or "random"; ignored when a
    ``sampler`` or a ``batch_sampler`` is given).  ``pin_memory``: whether the batches go to
    a CUDA device (None: whether CUDA is present).  ``context`` is the workers' start method;
    "auto" picks one that works where this is called (see
    :func:`~zarrfeed.training.data.start.start_method`).  ``ring``: the workers of a dataset
    with batched reads (``batch_ring``) reuse shared batch slots, which the consumer must
    copy out and free with :func:`~zarrfeed.training.data.ring.settle` (the training feed
    does); other consumers must leave it off.
    """
    collate_fn = collate_of(dataset, collate_fn)
    given = batch_sampler if batch_sampler is not None else sampler
    budgets = Budgets(
        batch_size, workers, preload, order, shuffle,
        None if given is None else (given.reason if isinstance(given, Ordering) else ""),
        train=train, pin_memory=pin_memory, ring=ring, context=context,
    )  # fmt: skip
    plan = plan_loading(data_facts(dataset, collate_fn), machine_facts(), world_facts(), budgets)
    run_preload(dataset, plan)
    if plan.order is not None:
        sampler = build_order(plan.order, dataset, seed=seed)
    elif plan.random_order:
        sampler = RandomSampler(dataset)
    loader = build_loader(
        dataset, plan, batch_size, context, collate_fn, sampler, batch_sampler, drop_last
    )
    if log:
        log(plan.loader.log_block(name))
    return loader, plan.loader


def build_loader(
    dataset: Dataset,
    plan: LoadingPlan,
    batch_size: int,
    context: str,
    collate_fn: Callable | None = None,
    sampler: Sampler | None = None,
    batch_sampler: Sampler | None = None,
    drop_last: bool = False,
) -> DataLoader:
    """The DataLoader ``plan`` describes, its workers started by ``context``, over
    ``dataset`` in ``(epoch, index)`` keys (:mod:`~zarrfeed.training.data.epochs`): from
    ``batch_sampler``, else batches of ``sampler`` (else in order).  The plan's loader
    settings then hold every reason, the start method's too."""
    if plan.loader.num_workers:
        plan.loader.context, why = start_method(context, dataset)
        started(plan, why)
    plan.loader.reasons = plan.reasons()
    keyed, epoch = EpochIndexed(dataset), epoch_of(dataset)
    if batch_sampler is not None:
        return DataLoader(
            keyed, batch_sampler=EpochKeys(batch_sampler, epoch), collate_fn=collate_fn,
            **plan.loader.kwargs(),
        )  # fmt: skip
    return DataLoader(
        keyed,
        batch_size=batch_size,
        sampler=EpochKeys(sampler if sampler is not None else SequentialSampler(dataset), epoch),
        collate_fn=collate_fn,
        drop_last=drop_last,
        **plan.loader.kwargs(),
    )


def batch_len(batch: Any) -> int:
    """Samples in a collated batch (every zarrfeed batch carries ``item``)."""
    if isinstance(batch, dict):
        value = batch.get("item", next(iter(batch.values())))
        return len(value)
    return len(batch[0]) if isinstance(batch, list | tuple) else len(batch)
