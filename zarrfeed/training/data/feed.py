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
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from zarrfeed.training.data.device import DevicePatches, DeviceSlots, device_source
from zarrfeed.training.data.epochs import EpochChain, LoaderKeys, Tag
from zarrfeed.training.data.facts import Budgets, World, data_facts, machine_facts, world_facts
from zarrfeed.training.data.loader import build_loader, collate_of, run_preload
from zarrfeed.training.data.plan import LoadingPlan, plan_loading
from zarrfeed.training.data.ring import settle
from zarrfeed.training.data.sampler import (
    BlockSampler,
    ResumableSampler,
    build_order,
    follow_order,
    sample_order,
)

_DONE = object()


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
    device: torch.device,
    budgets: Budgets,
    world: World | None = None,
    collate_fn: Callable | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
    depth: int = 2,
) -> Feed:
    """The feed for ``dataset`` on ``device``, as the loading plan
    (:func:`~zarrfeed.training.data.plan.plan_loading`) has it: the device tier when it can
    cut the batches (then the epoch order for it), else one persistent DataLoader over the
    host cache.  The plan and its reasons are logged as one block.

    ``budgets``: what was configured; a feed always weighs the device tier, so a
    ``device_cache`` of None reads as "auto", and a ``pin_memory`` of None as whether
    ``device`` is CUDA.  ``world``: this process's rank (None: rank 0 of 1); ``seed``: the
    epoch orders' and the workers' seed; ``depth``: batches prepared ahead."""
    collate_fn = collate_of(dataset, collate_fn)
    budgets = replace(
        budgets,
        device_cache=budgets.device_cache or "auto",
        pin_memory=device.type == "cuda" if budgets.pin_memory is None else budgets.pin_memory,
    )
    world = world_facts() if world is None else world
    tier = budgets.device_cache != "off"
    facts = data_facts(dataset, collate_fn, device=tier, batch_size=budgets.batch_size)
    plan = plan_loading(facts, machine_facts(device, tier), world, budgets)
    run_preload(dataset, plan)
    assert plan.order is not None  # the feed always walks an order of its own
    sampler = build_order(plan.order, dataset, world.rank, world.world, seed)
    if plan.tier == "loader":
        feed = _loader_feed(dataset, plan, sampler, budgets, device, collate_fn, seed, depth)
    else:
        holder = device_source(dataset, device, plan.tier, plan.device_budget, budgets.batch_size)
        feed = _device_feed(dataset, plan, holder, sampler, budgets.batch_size, device, depth)
    if log:
        log(plan.loader.log_block())
    return feed


def _device_feed(
    dataset: Any,
    plan: LoadingPlan,
    holder: DevicePatches | DeviceSlots,
    sampler: ResumableSampler | BlockSampler,
    batch_size: int,
    device: torch.device,
    depth: int,
) -> Feed:
    """Batches cut on the device by ``holder``, in ``sampler``'s order, then augmented there
    as a whole when the dataset declares an augmentation (the host path augments each
    sample alike, by (seed, epoch, index))."""
    plan.loader.reasons = plan.reasons()
    chain = EpochChain(sampler, batch_size)
    ahead = None
    if isinstance(holder, DeviceSlots) and isinstance(sampler, BlockSampler):
        # out of core the host decodes the next block from this one's middle: upload it then
        ahead = BlockAhead(sampler, dataset, holder, batch_size, half=not dataset.cache.in_ram)

    def produce(start: Callable[[], Tag | None]) -> Iterator[tuple[Tag, Any]]:
        begin = start()
        if begin is None:
            return
        augment = dataset.augment
        for tag, indices in chain.batches(*begin):
            dataset.set_epoch(tag[0])  # patch placement and crops are per (seed, epoch, index)
            if ahead is not None:
                ahead.at(tag)
            batch = holder.batch(indices)
            if augment is not None:
                batch = augment.apply(batch, dataset.seed, tag[0], indices)
            yield tag, batch

    feed = Feed(produce, device, chain.per_epoch, depth, plan.loader.reasons)
    feed.source, feed.sampler = holder, sampler
    return feed


def _loader_feed(
    dataset: Dataset,
    plan: LoadingPlan,
    sampler: ResumableSampler | BlockSampler,
    budgets: Budgets,
    device: torch.device,
    collate_fn: Callable | None,
    seed: int,
    depth: int,
) -> Feed:
    """Batches from one persistent DataLoader, keyed by (epoch, index), in ``sampler``'s
    order epoch after epoch."""
    chain = EpochChain(sampler, budgets.batch_size)
    keys = LoaderKeys(chain)
    loader = build_loader(
        dataset, plan, budgets.batch_size, budgets.context, collate_fn, batch_sampler=keys
    )
    if plan.threads is not None:  # the model trains on the CPU beside the workers
        torch.set_num_threads(plan.threads)
    # Batch slots the workers reuse are freed once copied out (the DataLoader pins otherwise).
    pin = plan.loader.pin_memory and plan.loader.ring
    # The iterator starts in the producer thread while the model is built: its workers' base
    # seed comes from a generator of its own, never from the global one the model draws on.
    loader.generator = torch.Generator().manual_seed(seed)

    def produce(start: Callable[[], Tag | None]) -> Iterator[tuple[Tag, Any]]:
        keys.start_with(start)
        for batch in loader:  # one iterator for the whole run: it never ends by itself
            yield keys.tags.popleft(), settle(batch, pin)

    feed = Feed(produce, device, chain.per_epoch, depth, plan.loader.reasons)
    feed.sampler = sampler
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
