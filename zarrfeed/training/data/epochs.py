"""How the epoch reaches loader workers: in the keys.

Samples depend on (seed, epoch, index).  Every index a loader hands its workers is an
``(epoch, index)`` pair, and a worker sets its own copy of the dataset to that epoch before
reading: the epoch travels with the work itself.  That is the one way that holds for every
case: persistent workers (nothing has to reach them between epochs), fork, forkserver and
spawn alike (a pair pickles like an index), workers running ahead into the next epoch while
the last batches of this one are read (each batch carries its own epoch), and a resumed run
(the keys from a checkpoint's place are the keys an uninterrupted run read there).  A plain
loader's keys carry the dataset's epoch as set in the process that iterates it
(:class:`EpochKeys`); the training feed's carry the epoch of each batch (:class:`LoaderKeys`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Sampler

from zarrfeed.training.data.protocols import (
    BatchedReads,
    EpochAware,
    Ordering,
    WorkerConfigurable,
    WorkerSettings,
)

Tag = tuple[int, int]  # (epoch, batch position within the epoch)
Key = tuple[int, int]  # (epoch, sample index)


class EpochIndexed(Dataset):
    """``dataset`` indexed by ``(epoch, index)`` keys: each read first sets the epoch its
    sample belongs to, in the process that reads it."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def _set_epoch(self, epoch: int) -> None:
        if isinstance(self.dataset, EpochAware):
            self.dataset.set_epoch(epoch)

    def configure_worker(self, settings: WorkerSettings) -> None:
        if isinstance(self.dataset, WorkerConfigurable):
            self.dataset.configure_worker(settings)

    def __getitem__(self, key: Key) -> Any:
        self._set_epoch(key[0])
        return self.dataset[key[1]]

    def __getitems__(self, keys: list[Key]) -> Any:
        epochs = {e for e, _ in keys}
        if len(epochs) != 1:
            raise ValueError(f"a batch spans epochs {sorted(epochs)}: the feed never cuts one so")
        self._set_epoch(keys[0][0])
        indices = [i for _, i in keys]
        if isinstance(self.dataset, BatchedReads):
            return self.dataset.__getitems__(indices)
        return [self.dataset[i] for i in indices]


def epoch_of(dataset: Any) -> Callable[[], int]:
    """The current epoch of ``dataset`` (0 for one that has none), read when called."""
    if isinstance(dataset, EpochAware):
        return lambda: dataset.epoch
    return lambda: 0


class EpochKeys(Sampler[Any]):
    """``order``'s indices (or batches of them) as ``(epoch, index)`` keys, the epoch read
    from ``epoch()`` as each pass begins, in the process that iterates the loader."""

    def __init__(self, order: Any, epoch: Callable[[], int]) -> None:
        self.order, self._epoch = order, epoch
        self.reason = order.reason if isinstance(order, Ordering) else ""

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epoch()
        for item in self.order:
            if isinstance(item, tuple):  # a key already
                yield item
            elif isinstance(item, Sequence):  # a batch
                yield [i if isinstance(i, tuple) else (epoch, int(i)) for i in item]
            else:
                yield (epoch, int(item))

    def __len__(self) -> int:
        return len(self.order)


class EpochChain:
    """Fixed-size batches of a resumable sampler's indices, epoch after epoch without end.

    ``sampler`` has ``set_epoch(epoch, start)`` (start in samples) and yields the rest of
    that epoch; the last incomplete batch of each epoch is dropped, as a DataLoader with
    ``drop_last=True`` does.
    """

    def __init__(self, sampler: Ordering, batch_size: int) -> None:
        self.sampler, self.batch_size = sampler, batch_size
        sampler.set_epoch(0, 0)
        self.per_epoch = len(sampler) // batch_size
        if not self.per_epoch:
            raise ValueError(
                f"{len(sampler)} samples per epoch cannot fill a batch of {batch_size}"
            )

    def batches(self, epoch: int, position: int) -> Iterator[tuple[Tag, np.ndarray]]:
        """(tag, indices) from batch ``position`` of ``epoch`` on."""
        b = self.batch_size
        while True:
            if position < self.per_epoch:
                self.sampler.set_epoch(epoch, position * b)
                order = iter(self.sampler)
                while len(chunk := list(islice(order, b))) == b:
                    yield (epoch, position), np.asarray(chunk, dtype=np.int64)
                    position += 1
            epoch, position = epoch + 1, 0


class LoaderKeys(Sampler[list[Key]]):
    """The training feed's batch sampler: :class:`EpochChain`'s batches as (epoch, index)
    keys, from the start it is given once the trainer knows it (:meth:`start_with`; the
    workers are already starting meanwhile); the tags go to ``tags`` in the order the
    DataLoader returns them."""

    def __init__(self, chain: EpochChain) -> None:
        self.chain, self.tags = chain, deque()
        self._start: Callable[[], Tag | None] = lambda: None
        self.reason = chain.sampler.reason

    def start_with(self, start: Callable[[], Tag | None]) -> None:
        """Take the place to begin from ``start()`` (None: closed before it began)."""
        self._start = start

    def __iter__(self) -> Iterator[list[Key]]:
        start = self._start()
        if start is None:  # closed before it began
            return
        for tag, indices in self.chain.batches(*start):
            self.tags.append(tag)
            yield [(tag[0], int(i)) for i in indices]
