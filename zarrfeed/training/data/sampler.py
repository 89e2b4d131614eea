"""Epoch orders the trainer can resume mid-epoch: a plain shuffle, and a block shuffle for
datasets larger than their cache.

Both follow ``DistributedSampler``: a permutation seeded by (seed, epoch), padded so every rank
gets the same count, one shard per rank; ``set_epoch(epoch, start)`` starts an epoch at
position ``start`` of this rank's order (what a checkpoint records), and ``len`` counts what
is left.  The block sampler (TorchIO's Queue and Streaming's block shuffles, applied to cache
units) keeps the working set inside the cache: each epoch shuffles the partitions, gives each
rank a contiguous run of them — so each machine's cache holds only its ranks' data — cuts the
run into blocks whose units fit half the cache, shuffles samples within each block, and
decodes the next block's units in a background thread while the current one is read.  Its
order depends on the block size, which follows the memory a machine has: a checkpoint records
the order (:func:`sample_order`) and a resumed run takes it up (:func:`follow_order`), so
the interrupted epoch goes on in the order it began.  From
an object store, the block after the current one is also fetched into the disk tier as soon as
the current one starts (nothing is evicted for it), so the bucket is read while the RAM cache
still holds the block before.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from zarrfeed.training.data.protocols import StoreBacked

log = logging.getLogger("zarrfeed.training")


def padded(order: np.ndarray, world: int) -> np.ndarray:
    """``order`` repeated from its start up to a multiple of ``world``, as ``DistributedSampler``
    pads (the first samples again, the whole order as often as needed): every rank gets the
    same count even when the world is more than twice the dataset, or DDP waits forever."""
    total = math.ceil(len(order) / world) * world
    return np.resize(order, total) if len(order) else order


class ResumableSampler(Sampler[int]):
    """``DistributedSampler``'s order — a permutation seeded by (seed, epoch), padded so every
    rank gets the same count, one shard per rank — that can start mid-epoch (``start``)."""

    def __init__(
        self, size: int, rank: int = 0, world: int = 1, seed: int = 0, note: str = ""
    ) -> None:
        """``note`` follows the ``reason`` (why this order was chosen)."""
        self.size, self.rank, self.world, self.seed = size, rank, world, seed
        self.per_rank = math.ceil(size / world)
        self.epoch, self.start = 0, 0
        self.reason = SHUFFLE_REASON + note

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = padded(torch.randperm(self.size, generator=g).numpy(), self.world)
        return iter(order[self.rank :: self.world][self.start :].tolist())

    def __len__(self) -> int:
        return self.per_rank - self.start


class BlockSampler(Sampler[int]):
    """Shuffles within blocks of partitions whose cache units fit ``block_bytes`` (half the
    cache by default) and prefetches the next block while the current one is read.

    ``dataset`` provides ``sample_items()`` (partition per sample), ``partition_bytes()``
    (working set per partition), ``sample_units(indices)``, ``cache.prefetch`` and
    ``cache.read_ahead`` (see
    :class:`~zarrfeed.training.data.base.StoreDataset`).
    """

    def __init__(
        self,
        dataset: Any,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        block_bytes: int | None = None,
        prefetch: bool = True,
        reason: str | None = None,
    ) -> None:
        """``reason``: why this order, when the chooser knows better than the default."""
        self.dataset, self.rank, self.world, self.seed = dataset, rank, world, seed
        self.items = np.asarray(dataset.sample_items(), dtype=np.int64)
        self.size = len(self.items)
        self.per_rank = math.ceil(self.size / world)
        self.parts = int(self.items.max()) + 1 if self.size else 0
        self.part_bytes = np.asarray(dataset.partition_bytes(), dtype=np.int64)
        self.block_bytes = int(block_bytes or dataset.cache.capacity_bytes // 2)
        self.prefetch = prefetch
        self.epoch, self.start = 0, 0
        self._generation = 0
        self._pool: ThreadPoolExecutor | None = None
        self.reason = reason or block_reason(self.block_bytes, dataset.cache.capacity_bytes)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None}

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def take_up(self, block_bytes: int, why: str) -> None:
        """Cut blocks of at most ``block_bytes`` from now on (a resumed run takes up the
        smaller blocks of the run it continues); ``why`` is added to the reason."""
        self.block_bytes = int(block_bytes)
        self.reason += f"; {why}"

    def __len__(self) -> int:
        return self.per_rank - self.start

    def plan(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """This rank's whole order for the epoch (``epoch``, by default the current one) and
        the start of each block in it."""
        rng = np.random.default_rng([self.seed, self.epoch if epoch is None else epoch])
        position = np.empty(self.parts, np.int64)
        position[rng.permutation(self.parts)] = np.arange(self.parts)
        by_partition = np.argsort(position[self.items], kind="stable")
        by_partition = padded(by_partition, self.world)
        total = self.per_rank * self.world
        noise = rng.random(total)
        lo, hi = self.rank * self.per_rank, (self.rank + 1) * self.per_rank
        mine, noise = by_partition[lo:hi], noise[lo:hi]
        parts = self.items[mine]
        runs = np.flatnonzero(np.diff(parts, prepend=-1))  # where a partition's samples start
        run_block = np.empty(len(runs), np.int64)
        used, number = 0, 0
        for i, need in enumerate(self.part_bytes[parts[runs]].tolist()):
            if used and used + need > self.block_bytes:
                number, used = number + 1, 0
            used += need
            run_block[i] = number
        block = np.repeat(run_block, np.diff(np.append(runs, len(mine))))
        order = mine[np.lexsort((noise, block))]
        return order, np.flatnonzero(np.diff(block, prepend=-1))

    def __iter__(self) -> Iterator[int]:
        order, starts = self.plan()
        ends = np.append(starts[1:], len(order))
        self._generation += 1
        generation = self._generation
        first = int(np.searchsorted(ends, self.start, side="right"))
        if first == len(starts):
            return
        if self.prefetch:
            self._submit(order[max(self.start, starts[first]) : ends[first]], None, generation)
        try:
            for b in range(first, len(starts)):
                lo, hi = max(self.start, int(starts[b])), int(ends[b])
                if self.prefetch and b + 1 < len(starts):  # into the disk tier only
                    self._submit(order[hi : int(ends[b + 1])], None, generation, decode=False)
                # The loader's workers read a few batches behind this position: start on the
                # next block halfway through this one, when the previous block is done with.
                half = max(lo, (int(starts[b]) + hi) // 2)
                yield from order[lo:half].tolist()
                if self.prefetch and b + 1 < len(starts):
                    following = order[hi : int(ends[b + 1])]
                    self._submit(following, order[starts[b] : hi], generation)
                yield from order[half:hi].tolist()
            # A finished pass moves on to the next epoch, for loops that never call set_epoch
            # (the trainer calls it before every pass, which overrides this).
            self.epoch, self.start = self.epoch + 1, 0
        finally:
            if self._generation == generation:  # no later pass has started: stop prefetching
                self._generation += 1  # what is under way stops at its next unit
                pool, self._pool = self._pool, None
                if pool is not None:  # its thread ends once that is done, not at exit
                    pool.shutdown(wait=False, cancel_futures=True)

    def _submit(
        self, indices: np.ndarray, keep: np.ndarray | None, generation: int, decode: bool = True
    ) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zarrfeed-prefetch")
        wanted = lambda: self._generation == generation  # noqa: E731
        self._pool.submit(self._prefetch, indices, keep, wanted, decode)

    def _prefetch(
        self,
        indices: np.ndarray,
        keep: np.ndarray | None,
        wanted: Callable[[], bool],
        decode: bool,
    ) -> None:
        """Decode units of ``indices`` into the cache (``decode``), or only fetch their
        chunks into the disk tier."""
        try:
            if not wanted():
                return
            cache, units = self.dataset.cache, self.dataset.sample_units
            if decode:
                cache.prefetch(units(indices), wanted, None if keep is None else units(keep))
            else:
                cache.read_ahead(units(indices), wanted)
        except Exception as exc:  # the readers decode what is missing and report errors
            if wanted():  # after its pass ended (a closed store, say) nobody needs it
                log.warning("prefetch of the next block failed: %s", exc)


SHUFFLE_REASON = "shuffled over the whole dataset (seed, epoch)"


def block_reason(block_bytes: int, capacity_bytes: int) -> str:
    """Why a block shuffle, in its default size: half the cache."""
    return (
        f"block shuffle: partitions in blocks of <= {block_bytes / 1e9:.3f} GB of cache "
        f"units (half of {capacity_bytes / 1e9:.3f} GB), shuffled within each "
        "block, next block prefetched"
    )


@dataclass(frozen=True)
class OrderPlan:
    """The epoch order chosen: "block" (a :class:`BlockSampler` of ``block_bytes``, None:
    half the cache), "shuffle" (a :class:`ResumableSampler`), and why (``reason``, the
    sampler's own)."""

    kind: str
    reason: str
    block_bytes: int | None = None


def choose_order(
    mode: str, cache: tuple[bool, int, int, int] | None, name: str = "the dataset"
) -> OrderPlan:
    """The epoch order for ``mode`` ("block", "random", or "auto": a block shuffle when the
    decoded arrays exceed the cache budget); ``cache``: (in RAM, decoded bytes, budget,
    capacity) of the dataset's cache, or None when it has none."""
    if mode not in ("auto", "block", "random"):
        raise ValueError(f"sampler must be 'auto', 'block' or 'random', got {mode!r}")
    beyond_ram = cache is not None and not cache[0]
    if mode == "block" or (mode == "auto" and beyond_ram):
        if cache is None:
            raise ValueError(f"{name} has no cache to block-shuffle for")
        _, nbytes, budget, capacity = cache
        reason = block_reason(capacity // 2, capacity)
        if mode == "auto":
            reason += f" (auto: {nbytes / 1e9:.2f} GB decoded > {budget / 1e9:.2f} GB cache budget)"
        return OrderPlan("block", reason)
    note = ""
    if mode == "auto" and cache is not None:
        note = f" (auto: the dataset fits its {cache[2] / 1e9:.2f} GB cache)"
    return OrderPlan("shuffle", SHUFFLE_REASON + note)


def build_order(
    plan: OrderPlan, dataset: Any, rank: int = 0, world: int = 1, seed: int = 0
) -> ResumableSampler | BlockSampler:
    """The sampler ``plan`` chose, over ``dataset``."""
    if plan.kind == "block":
        return BlockSampler(dataset, rank, world, seed, plan.block_bytes, reason=plan.reason)
    note = plan.reason.removeprefix(SHUFFLE_REASON)
    return ResumableSampler(len(dataset), rank, world, seed, note)


def make_sampler(
    dataset: Any, mode: str = "auto", rank: int = 0, world: int = 1, seed: int = 0
) -> ResumableSampler | BlockSampler:
    """``mode``: "block", "random", or "auto" — block shuffle when the dataset's decoded
    arrays exceed its cache budget.  The sampler's ``reason`` says which and why."""
    cache = dataset.cache if isinstance(dataset, StoreBacked) else None
    facts = None if cache is None else (
        cache.in_ram, cache.nbytes, cache.budget_bytes, cache.capacity_bytes
    )  # fmt: skip
    return build_order(
        choose_order(mode, facts, type(dataset).__name__), dataset, rank, world, seed
    )


def sample_order(sampler: ResumableSampler | BlockSampler) -> dict[str, Any]:
    """What decides ``sampler``'s order besides (seed, epoch, rank, world): a checkpoint
    records it, since a block shuffle's blocks follow the memory of the machine it ran on."""
    if isinstance(sampler, BlockSampler):
        return {"kind": "block", "block_bytes": sampler.block_bytes}
    return {"kind": "shuffle"}


def _described(order: dict[str, Any]) -> str:
    if order.get("kind") == "block":
        return f"block shuffle in blocks of <= {int(order['block_bytes']) / 1e9:.3f} GB"
    return "shuffle over the whole dataset"


def follow_order(
    sampler: ResumableSampler | BlockSampler, recorded: dict[str, Any] | None
) -> str | None:
    """Give ``sampler`` the order a checkpoint ``recorded`` (None: one written before orders
    were recorded, taken as it is), so that a resumed epoch neither repeats nor skips samples;
    or say why it cannot.  A block shuffle takes up the recorded blocks when they are no
    larger than its own (they fit the cache or device slots this one was sized for)."""
    mine = sample_order(sampler)
    if recorded is None or recorded == mine:
        return None
    if (
        isinstance(sampler, BlockSampler)
        and recorded.get("kind") == "block"
        and int(recorded["block_bytes"]) <= sampler.block_bytes
    ):
        sampler.take_up(
            int(recorded["block_bytes"]), f"{_described(recorded)}, as the run it resumes"
        )
        return None
    return (
        f"sample order: the checkpoint's run read a {_described(recorded)}, this one a "
        f"{_described(mine)}"
    )
