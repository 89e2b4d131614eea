"""A pipelined feed: the next batches are prepared while the current step runs.

One producer thread per training run, started before the model is built, prepares batches
``depth`` steps ahead of the training loop:

* from a DataLoader (the host path): one iterator, with persistent workers, lives across
  epochs — its batch sampler (:class:`EpochChain`) walks epoch after epoch, so there is
  no new iterator and no cold start at an epoch boundary, and the workers start while the
  model and optimiser are built;
* from the device tier (:mod:`~zarrfeed.training.data.device`): indices, uploads of missing
  cache units and the gather are queued ahead on the device.

On CUDA the producer issues its copies and gathers on a side stream and records an event
after each batch; the training loop makes its own stream wait for that event (the host does
not wait) and marks the batch's tensors as used by its stream, so a step never reads a
buffer still being written and the allocator never hands the memory back to the producer
before the step is done.  On the CPU the same thread and queue run without streams.

Every batch carries its (epoch, position): the trainer records where it is from the batch
it consumed, not from what the producer has prepared, so a checkpoint resumes exactly.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from zarrfeed.processes import usable_cpus
from zarrfeed.training.data.base import collate_batch
from zarrfeed.training.data.device import DevicePatches, DeviceSlots, device_source, plan_device
from zarrfeed.training.data.loader import LoaderPlan, local_world_size, make_loader
from zarrfeed.training.data.ring import settle
from zarrfeed.training.data.sampler import (
    BlockSampler,
    ResumableSampler,
    follow_order,
    make_sampler,
    sample_order,
)

Tag = tuple[int, int]  # (epoch, batch position within the epoch)
_DONE = object()


class EpochChain:
    """Fixed-size batches of a resumable sampler's indices, epoch after epoch without end.

    ``sampler`` has ``set_epoch(epoch, start)`` (start in samples) and yields the rest of
    that epoch; the last incomplete batch of each epoch is dropped, as a DataLoader with
    ``drop_last=True`` does.  ``dataset.set_epoch`` (when it has one) is called in the
    producer thread only by the device path, which reads no per-epoch randomness.
    """

    def __init__(self, sampler: Any, batch_size: int) -> None:
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


class EpochIndexed(Dataset):
    """``dataset`` indexed by ``(epoch, index)`` pairs, so one persistent DataLoader can
    read several epochs at once: each batch sets the epoch its samples belong to.

    In a worker the epoch is made private to that process first (``own_epoch``), so two
    workers reading batches of different epochs never see each other's.  Other attributes
    are the dataset's own (the cache, ``preload``, ``collate``).
    """

    _OWN = ("dataset", "_owner", "_own", "batch_ring")

    def __init__(self, dataset: Dataset) -> None:
        self.dataset, self._owner, self._own = dataset, os.getpid(), False
        # batch slots for the workers (make_loader sets it): applied to each worker's copy
        # of the dataset only, never to the caller's, which other loaders may read
        self.batch_ring = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self._OWN:
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # what the loader sets (batch_ring) and the workers' collate sets (shared_batches)
        # are the dataset's own settings
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __len__(self) -> int:
        return len(self.dataset)

    def _set_epoch(self, epoch: int) -> None:
        if os.getpid() != self._owner and not self._own:  # first batch in a worker
            own = getattr(self.dataset, "own_epoch", None)
            if own is not None:
                own()
            if hasattr(self.dataset, "batch_ring"):
                self.dataset.batch_ring = self.batch_ring
            self._own = True
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        if isinstance(key, tuple):
            self._set_epoch(key[0])
            key = key[1]
        return self.dataset[key]

    def __getitems__(self, keys: list[tuple[int, int]]) -> Any:
        epochs = {e for e, _ in keys}
        if len(epochs) != 1:
            raise ValueError(f"a batch spans epochs {sorted(epochs)}: the feed never cuts one so")
        self._set_epoch(keys[0][0])
        indices = [i for _, i in keys]
        fetch = getattr(self.dataset, "__getitems__", None)
        return fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]


class LoaderKeys(Sampler[list[tuple[int, int]]]):
    """The DataLoader's batch sampler: :class:`EpochChain`'s batches as (epoch, index)
    pairs, from the start the trainer gives once it knows it (the workers are already
    starting meanwhile); the tags go to ``tags`` in the order the DataLoader returns them."""

    def __init__(self, chain: EpochChain) -> None:
        self.chain, self.tags = chain, deque()
        self.start: Callable[[], Tag | None] = lambda: None
        self.reason = getattr(chain.sampler, "reason", "")

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        start = self.start()
        if start is None:  # closed before it began
            return
        for tag, indices in self.chain.batches(*start):
            self.tags.append(tag)
            yield [(tag[0], int(i)) for i in indices]


def to_device(batch: Any, device: torch.device) -> Any:
    """Copy a batch to ``device`` (asynchronously from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, list | tuple):
        for v in batch:
            yield from _tensors(v)


class Feed:
    """Batches prepared ``depth`` steps ahead in a producer thread, on a side CUDA stream.

    ``produce(start)`` runs in the producer thread: ``start()`` blocks until :meth:`begin`
    (None once closed) and it yields ``(tag, batch)`` pairs; whatever it does before
    calling ``start`` (starting loader workers) overlaps the caller's set-up.

    Timing, kept honest without synchronising the host on every step: the host's wait in
    :meth:`next` is the time the step waited for a batch that was not prepared yet.  On
    CUDA the step's stream may also wait on the device for a copy or gather still running;
    a pair of CUDA events around that wait measures it, read by :meth:`device_waits` after
    the trainer has synchronised at a log step.
    """

    def __init__(
        self,
        produce: Callable[[Callable[[], Tag | None]], Iterator[tuple[Tag, Any]]],
        device: torch.device,
        per_epoch: int,
        depth: int = 2,
        reasons: list[str] | None = None,
    ) -> None:
        self.device, self.per_epoch, self.reasons = device, per_epoch, reasons or []
        self.source: DevicePatches | DeviceSlots | None = None  # the device tier, if any
        self.sampler: ResumableSampler | BlockSampler | None = None  # the epoch order
        self._cuda = device.type == "cuda"
        # what was queued on the device before the feed (the device tier's uploads and
        # tables, on the caller's stream): the side stream starts after it
        self._origin = torch.cuda.current_stream(device) if self._cuda else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._start: Tag | None = None
        self._begun, self._stop = threading.Event(), threading.Event()
        self._waits: list[tuple[Any, Any]] = []
        self._produce = produce
        self._thread = threading.Thread(target=self._run, daemon=True, name="zarrfeed-feed")
        self._thread.start()

    # the producer ------------------------------------------------------------------------
    def _wait_start(self) -> Tag | None:
        while not self._begun.wait(0.1):
            if self._stop.is_set():
                return None
        return None if self._stop.is_set() else self._start

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        batches = None
        try:
            side = None
            if self._cuda:
                torch.cuda.set_device(self.device)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(self._origin)
            batches = self._produce(self._wait_start)
            self._produce = None  # the generator holds what it needs; closing it frees it
            while not self._stop.is_set():
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    found = next(batches, _DONE)
                    if found is _DONE:
                        break
                    tag, batch = found
                    batch = to_device(batch, self.device)
                    ready = None
                    if side is not None:
                        ready = torch.cuda.Event()
                        ready.record(side)
                if not self._put((tag, batch, ready)):
                    break
            self._put((None, StopIteration("the feed ended"), None))
        except BaseException as exc:  # the training loop raises it, with its traceback
            self._put((None, exc, None))
        finally:
            if batches is not None:
                batches.close()  # a DataLoader's workers end with it

    # the consumer ------------------------------------------------------------------------
    def order(self) -> dict[str, Any] | None:
        """What decides the epoch order (:func:`~zarrfeed.training.data.sampler.sample_order`),
        for a checkpoint to record."""
        return None if self.sampler is None else sample_order(self.sampler)

    def follow(self, recorded: dict[str, Any] | None) -> str | None:
        """Take up the epoch order a checkpoint recorded, before :meth:`begin`; why not,
        when it cannot (:func:`~zarrfeed.training.data.sampler.follow_order`)."""
        if self.sampler is None or self._begun.is_set():
            raise RuntimeError("Feed.follow: no sampler, or the feed has begun")
        return follow_order(self.sampler, recorded)

    def begin(self, epoch: int, position: int) -> None:
        """Start producing from batch ``position`` of ``epoch`` (a checkpoint's place)."""
        self._start = (epoch, position)
        self._begun.set()

    def next(self) -> tuple[Tag, Any]:
        """The next batch and its (epoch, position), safe to use on the current stream."""
        tag, batch, ready = self._queue.get()
        if tag is None:
            raise batch
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            before, after = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            before.record(stream)
            stream.wait_event(ready)
            after.record(stream)
            self._waits.append((before, after))
            for t in _tensors(batch):
                if t.device.type == "cuda":
                    t.record_stream(stream)
        return tag, batch

    def ready(self) -> list[Tag]:
        """Tags of the batches prepared and waiting, oldest first."""
        with self._queue.mutex:
            return [item[0] for item in self._queue.queue if item[0] is not None]

    def device_waits(self) -> list[float]:
        """Seconds the step's stream waited on the device for each batch since the last call
        (empty off CUDA); call it after the device has been synchronised."""
        waits = [before.elapsed_time(after) / 1000 for before, after in self._waits]
        self._waits.clear()
        return waits

    def close(self) -> None:
        """Stop the producer and let it release its workers and buffers."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(0.1)


def make_feed(
    dataset: Dataset,
    batch_size: int,
    device: torch.device,
    collate_fn: Callable | None = None,
    workers: int | str = "auto",
    preload: bool | str = "auto",
    order: str = "auto",
    device_cache: str = "auto",
    device_cache_gb: float | None = None,
    context: str = "forkserver",
    rank: int = 0,
    world: int = 1,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
    depth: int = 2,
) -> Feed:
    """The feed for ``dataset`` on ``device``, its tier chosen from the measured sizes.

    The device tier is decided first (:func:`~zarrfeed.training.data.device.plan_device`),
    then the epoch order for the tier that serves the batches: a shuffle of the whole
    dataset when its volumes are on the device, a block shuffle sized to the smaller of the
    device pool and the host cache when units stream through a slot pool, and the host
    cache's own choice (:func:`~zarrfeed.training.data.sampler.make_sampler`) for the
    DataLoader.  The choice and its reasons are logged as one block.
    """
    plan = plan_device(dataset, device, device_cache, batch_size, device_cache_gb)
    if plan.tier == "off":
        return _loader_feed(
            dataset, batch_size, device, plan.reasons, collate_fn, workers, preload, order,
            context, rank, world, seed, log, depth,
        )  # fmt: skip
    reasons = list(plan.reasons)
    cache = dataset.cache
    if cache.in_ram and preload in (True, "auto"):
        t0 = time.perf_counter()
        dataset.preload()
        reasons.append(f"host cache: preloaded {cache.nbytes / 1e9:.2f} GB in "
                       f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
    holder = device_source(dataset, device, plan, batch_size)
    sampler = _device_sampler(dataset, holder, order, rank, world, seed)
    chain = EpochChain(sampler, batch_size)
    reasons += [
        f"sampler: {sampler.reason}",
        "batches are cut on the device by one gather, prepared a step ahead: no workers",
    ]
    loader_plan = LoaderPlan(0, None, False, False, None, reasons)
    if log:
        log(loader_plan.log_block())

    ahead = None
    if isinstance(holder, DeviceSlots) and isinstance(sampler, BlockSampler):
        # out of core the host decodes the next block from this one's middle: upload it then
        ahead = BlockAhead(sampler, dataset, holder, batch_size, half=not cache.in_ram)

    def produce(start: Callable[[], Tag | None]) -> Iterator[tuple[Tag, Any]]:
        begin = start()
        if begin is None:
            return
        for tag, indices in chain.batches(*begin):
            dataset.set_epoch(tag[0])  # patch placement and crops are per (seed, epoch, index)
            if ahead is not None:
                ahead.at(tag)
            yield tag, holder.batch(indices)

    feed = Feed(produce, device, chain.per_epoch, depth, reasons)
    feed.source, feed.sampler = holder, sampler
    return feed


class BlockAhead:
    """Tells a slot pool, at each block's first batch, which units this block and the next
    one read, so that it uploads the next block's while this one trains (the block
    sampler's blocks fit half the pool: the other half is the next block's)."""

    def __init__(
        self, sampler: BlockSampler, dataset: Any, pool: DeviceSlots, batch_size: int, half: bool
    ) -> None:
        self.sampler, self.dataset, self.pool = sampler, dataset, pool
        self.batch_size, self.half = batch_size, half
        self._epoch, self._block, self._plan = -1, -1, []

    def _blocks(self, epoch: int) -> list[np.ndarray]:
        order, starts = self.sampler.plan(epoch)
        return np.split(order, starts[1:])

    def at(self, tag: Tag) -> None:
        epoch, position = tag
        if epoch != self._epoch:
            self._epoch, self._block, self._plan = epoch, -1, self._blocks(epoch)
        first = position * self.batch_size
        ends = np.cumsum([len(b) for b in self._plan])
        block = int(np.searchsorted(ends, first, side="right"))
        if block == self._block or block >= len(self._plan):
            return
        self._block = block
        following = (
            self._plan[block + 1] if block + 1 < len(self._plan) else self._blocks(epoch + 1)[0]
        )
        batches = max(1, (int(ends[block]) - first) // self.batch_size)
        units = self.dataset.sample_units
        self.pool.plan_ahead(
            units(self._plan[block]), units(following), batches, batches // 2 if self.half else 0
        )


def _device_sampler(
    dataset: Any, holder: DevicePatches | DeviceSlots, order: str, rank: int, world: int, seed: int
) -> ResumableSampler | BlockSampler:
    if isinstance(holder, DeviceSlots) and order == "auto":
        host = dataset.cache.capacity_bytes or holder.nbytes()
        block = min(host, holder.nbytes()) // 2
        sampler = BlockSampler(dataset, rank, world, seed, block_bytes=block)
        sampler.reason = (
            f"block shuffle: partitions in blocks of <= {block / 1e9:.3f} GB of cache units "
            f"(half the smaller of the {holder.nbytes() / 1e9:.3f} GB of device slots and the "
            f"{host / 1e9:.3f} GB host cache), shuffled within each block; the device slots "
            "hold this block's units in one half and the next block's, uploaded a few per "
            "batch while this one trains, in the other"
        )
        return sampler
    if order == "block":
        return make_sampler(dataset, "block", rank, world, seed)
    sampler = ResumableSampler(len(dataset), rank, world, seed)
    where = "on the device" if isinstance(holder, DevicePatches) else "in device slots"
    sampler.reason += f" (the batches are cut {where})"
    return sampler


def share_cpus(workers: int) -> str:
    """Give torch's intra-op threads this rank's share of the CPUs less its loader workers,
    when the model trains on the CPU; what was done, as a reason line.  torch's default, a
    thread per CPU in every rank, spins against the workers and whatever else runs: on 2
    CPUs with 1 worker and other processes busy, 60 defect-segmentation steps took 58 s on 2
    threads and 27 s on 1.  ``OMP_NUM_THREADS``, when set, wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return f"intra-op threads: {torch.get_num_threads()} (OMP_NUM_THREADS)"
    cpus, ranks = usable_cpus(), local_world_size()
    threads = max(1, cpus // ranks - workers)
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)
    return (f"intra-op threads: {torch.get_num_threads()} (the model trains on the CPU: "
            f"{cpus} CPUs, {ranks} rank(s) here, {workers} loader workers each)")  # fmt: skip


def _loader_feed(
    dataset: Dataset,
    batch_size: int,
    device: torch.device,
    notes: list[str],
    collate_fn: Callable | None,
    workers: int | str,
    preload: bool | str,
    order: str,
    context: str,
    rank: int,
    world: int,
    seed: int,
    log: Callable[[str], None] | None,
    depth: int,
) -> Feed:
    """Batches from one persistent DataLoader over :class:`EpochIndexed` ``dataset``."""
    sampler = make_sampler(dataset, order, rank, world, seed)
    chain = EpochChain(sampler, batch_size)
    keys = LoaderKeys(chain)
    loader, plan = make_loader(
        EpochIndexed(dataset),
        batch_size,
        workers=workers,
        preload=preload,
        collate_fn=collate_fn,
        batch_sampler=keys,
        context=context,
        log=None,
        pin_memory=device.type == "cuda",
        # batch slots the workers reuse, freed below once copied out: only where the batch
        # is handed on whole (collate_batch); default_collate copies it anyway
        ring=hasattr(dataset, "batch_ring")
        and (collate_fn or getattr(dataset, "collate", None)) is collate_batch,
    )
    pin = plan.pin_memory and plan.ring  # the DataLoader pins otherwise
    plan.reasons[:0] = notes
    if device.type == "cpu":
        plan.reasons.append(share_cpus(plan.num_workers))
    # The iterator starts in the producer thread while the model is built: its workers' base
    # seed comes from a generator of its own, never from the global one the model draws on.
    loader.generator = torch.Generator().manual_seed(seed)
    if log:
        log(plan.log_block())

    def produce(start: Callable[[], Tag | None]) -> Iterator[tuple[Tag, Any]]:
        keys.start = start
        for batch in loader:  # one iterator for the whole run: it never ends by itself
            yield keys.tags.popleft(), settle(batch, pin)

    feed = Feed(produce, device, chain.per_epoch, depth, plan.reasons)
    feed.sampler = sampler
    return feed
