"""DataLoaders that size themselves: workers from the CPUs this process may use, the local
world size, the dataset size and the memory budget; the sampler from whether the dataset fits
its cache; the choice is logged with its reasons."""

from __future__ import annotations

import functools
import math
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from zarrfeed.errors import ConfigError
from zarrfeed.processes import available_memory, cpu_budget, process_alive
from zarrfeed.training.data.sampler import make_sampler
from zarrfeed.training.data.start import start_method

WORKER_OVERHEAD_BYTES = 300 << 20  # interpreter + torch + zarr per worker, measured ~250 MB
# Out of core, batches in flight live in shared memory beside the cache: they may add this
# share of its budget (the cache itself never exceeds it).
IN_FLIGHT_SHARE = 0.05
# Batches in shared memory besides the workers' prefetched ones: the one the training step
# holds and the one being handed to it (measured: 2 workers × prefetch 1 peak at 4 batches).
HELD_BATCHES = 2


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


@dataclass
class LoaderPlan:
    """The chosen DataLoader settings and why."""

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    persistent_workers: bool
    context: str | None
    reasons: list[str] = field(default_factory=list)
    # workers write batches into slots they reuse; the consumer copies each out (pinned when
    # pin_memory) and frees its slot (ring.settle): the DataLoader itself pins nothing
    ring: bool = False

    def kwargs(self) -> dict[str, Any]:
        pin = self.pin_memory and not self.ring
        kw: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": pin}
        if self.num_workers:
            kw |= {
                "prefetch_factor": self.prefetch_factor,
                "persistent_workers": self.persistent_workers,
                "multiprocessing_context": self.context,
                "worker_init_fn": functools.partial(_init_worker, os.getpid()),
            }
        return kw

    def log_block(self, name: str = "train") -> str:
        """The configuration in one block, as the training log prints it."""
        lines = [
            f"[{name}] ========== data loading configuration ==========",
            *[f"[{name}] {r}" for r in self.reasons],
        ]
        lines.append(
            f"[{name}] num_workers={self.num_workers} prefetch_factor={self.prefetch_factor} "
            f"pin_memory={self.pin_memory} persistent_workers={self.persistent_workers} "
            f"context={self.context}" + (" batch_ring=on" if self.ring else "")
        )
        return "\n".join(lines)


def _init_worker(owner: int, _: int) -> None:
    torch.set_num_threads(1)  # workers run side by side; intra-op threads would oversubscribe
    # Ctrl-C in a terminal reaches every process of the foreground group: the owner decides
    # (the trainer finishes its step and saves); a worker that died of it would fail that step
    # with "DataLoader worker exited unexpectedly".  Workers still end with their owner.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(owner,), daemon=True, name="owner-watch").start()


def _exit_with(owner: int) -> None:
    """End this worker when the process that owns its DataLoader ends.

    A forkserver worker is a child of the fork server, not of its owner, and holds the fork
    server open: torch's watchdog (its parent's pid) never fires, so a SIGKILLed or
    OOM-killed trainer would leave its workers, and the shared memory they map, forever.
    """
    pidfd_open = getattr(os, "pidfd_open", None)  # Linux 5.3+
    try:
        pidfd = pidfd_open(owner) if pidfd_open else None
    except ProcessLookupError:
        os._exit(1)
    except OSError:
        pidfd = None
    if pidfd is None:  # no pidfds here: poll
        while process_alive(owner):
            time.sleep(1.0)
        os._exit(1)
    select.select([pidfd], [], [])  # readable once the owner has exited
    os._exit(1)


def plan_loader(
    dataset_len: int,
    batch_size: int,
    workers: int | str = "auto",
    sample_bytes: int = 0,
    cache_bytes: int = 0,
    train: bool = True,
    context: str = "forkserver",
    in_flight_bytes: int = 0,
    pin_memory: bool | None = None,
    ring: bool = False,
) -> LoaderPlan:
    """Resolve ``workers`` ("auto", "cpu*0.9", N) against this machine and dataset;
    ``in_flight_bytes`` (when set) bounds the shared memory of the batches in flight;
    ``pin_memory``: whether batches go to a CUDA device (None: whether CUDA is present);
    ``ring``: workers reuse batch slots that the consumer frees (:mod:`.ring`)."""
    cpus, how = cpu_budget()
    world = local_world_size()
    reasons = [f"CPUs usable: {cpus} ({how}); local world size: {world}"]
    batches = max(1, math.ceil(dataset_len / batch_size))
    reasons.append(f"dataset: {dataset_len} samples, batch {batch_size} -> {batches} batches")
    per_rank = max(1, cpus // world)
    if isinstance(workers, int) or str(workers).isdigit():
        n = int(workers)
        reasons.append(f"workers: {n} (as configured)")
    else:
        spec = str(workers)
        if spec == "auto":
            share = 0.8  # "auto" = 80 % of the CPUs, leaving room for the main process
        elif spec.startswith("cpu*"):
            share = float(spec[4:])
        else:
            raise ValueError(
                f"workers must be 'auto', 'cpu*<fraction>' or an integer, got {workers!r}"
            )
        n = max(1, math.floor(cpus * share / world))
        reasons.append(f"workers: {n} from {spec} = {share:g} x {cpus} CPUs / {world} ranks")
        # Few samples per worker make worker start-up and cache warm-up dominate.
        small = 2 if dataset_len < 50 else 4 if dataset_len < 200 else None
        if small is not None and n > small:
            n = small
            reasons.append(
                f"capped at {small}: small dataset ({dataset_len} samples: start-up would dominate)"
            )
        if n > batches:
            n = batches
            reasons.append(f"capped at {batches}: one batch per worker at most")
        n = min(n, per_rank)
    prefetch = (4 if train else 2) if n else None
    if n and sample_bytes:
        room = available_memory() - cache_bytes
        per_worker = WORKER_OVERHEAD_BYTES + (prefetch or 0) * batch_size * sample_bytes
        fit = max(0, room // per_worker)
        if fit < n:
            n = int(fit)
            reasons.append(
                f"capped at {n}: {room >> 20} MiB free after the cache, "
                f"{per_worker >> 20} MiB per worker"
            )
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    if n and in_flight_bytes and sample_bytes:
        n, prefetch = _fit_in_flight(n, prefetch or 0, batch_size * sample_bytes,
                                     in_flight_bytes, pin, reasons, ring)  # fmt: skip
    if pin_memory is None:
        reasons.append("pinned memory: " + ("on (CUDA present)" if pin else "off (no CUDA)"))
    else:
        reasons.append(
            "pinned memory: "
            + ("on (training on CUDA)" if pin else "off (the training device is not CUDA)")
        )
    plan = LoaderPlan(n, prefetch if n else None, pin, n > 0, context if n else None, reasons)
    if n and ring:
        plan.ring = True
        reasons.append(
            f"batches: {prefetch + 1} slots of {batch_size * sample_bytes / 1e6:.1f} MB of shared "
            "memory per worker, reused (fresh shared memory per batch costs more than the "
            "batch); the feed copies each batch out"
            + (" into pinned memory" if pin else "")
            + " and frees its slot"
        )
    return plan


def _fit_in_flight(
    n: int, prefetch: int, batch: int, room: int, pinned: bool, reasons: list[str],
    ring: bool = False,
) -> tuple[int, int]:  # fmt: skip
    """(workers, prefetch) whose batches in flight — ``n`` × ``prefetch`` prefetched, the
    held ones, one more pinned copy with CUDA — fit in ``room`` bytes of shared memory;
    :class:`ConfigError` in one line, with the smallest budget that works, when not even one
    worker with one batch fits.  With a ``ring`` each worker holds ``prefetch + 1`` slots
    (the one being copied out besides its prefetched ones) and nothing else is shared."""
    if ring:
        return _fit_ring(n, prefetch, batch, room, pinned, reasons)
    held = HELD_BATCHES + int(pinned)
    slots = room // batch - held  # prefetched batches the room leaves
    if slots < 1:

        def smallest(workers: int) -> str:  # in cache_gb's unit (GiB), rounded up
            return f"{math.ceil((workers + held) * batch / IN_FLIGHT_SHARE / 2**30 * 1e3) / 1e3}"

        raise ConfigError(
            f"cache budget too small for batches of {batch} bytes with workers: batches in "
            f"flight may take {room} bytes ({IN_FLIGHT_SHARE:.0%} of the budget), one worker "
            f"needs {(1 + held) * batch}; the smallest cache_gb that works is {smallest(1)}"
            + (f" ({smallest(n)} for {n} workers)" if n > 1 else "")
            + ", or use workers=0"
        )
    if slots < n:
        reasons.append(f"capped at {slots} workers: one batch each in flight, within {room} B")
        n = slots
    fit = min(prefetch, slots // n)
    if fit < prefetch:
        reasons.append(
            f"prefetch_factor {fit}: batches in flight kept within "
            f"{room / 1e6:.1f} MB of shared memory"
        )
    return n, fit


def _fit_ring(
    n: int, prefetch: int, batch: int, room: int, pinned: bool, reasons: list[str]
) -> tuple[int, int]:
    """:func:`_fit_in_flight` for workers with batch rings: ``n × (prefetch + 1)`` slots
    (and one pinned copy with CUDA) within ``room``."""
    slots = room // batch - int(pinned)
    if slots < 2:
        need = 2 + int(pinned)
        smallest = math.ceil(need * batch / IN_FLIGHT_SHARE / 2**30 * 1e3) / 1e3
        raise ConfigError(
            f"cache budget too small for batches of {batch} bytes with workers: batches in "
            f"flight may take {room} bytes ({IN_FLIGHT_SHARE:.0%} of the budget), one worker "
            f"needs {need * batch}; the smallest cache_gb that works is {smallest}, or use "
            "workers=0"
        )
    if 2 * n > slots:
        n = slots // 2
        reasons.append(f"capped at {n} workers: two batch slots each, within {room} B")
    fit = min(prefetch, slots // n - 1)
    if fit < prefetch:
        reasons.append(
            f"prefetch_factor {fit}: batch slots kept within {room / 1e6:.1f} MB of shared memory"
        )
    return n, fit


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
    collate_fn = collate_fn or getattr(dataset, "collate", None)
    cache = getattr(dataset, "cache", None)
    budget = cache.budget_bytes if cache is not None else 0
    notes = []
    if cache is not None:
        total = cache.nbytes
        fits = f"{total / 1e9:.2f} GB decoded, cache budget {budget / 1e9:.2f} GB"
        if cache.in_ram and (preload is True or preload == "auto"):
            t0 = time.perf_counter()
            dataset.preload()
            notes.append(f"cache: preloaded {fits} in {time.perf_counter() - t0:.1f}s")
        elif cache.in_ram:
            notes.append(f"cache: {fits}: filled on demand")
        else:
            notes.append(
                f"cache: {fits}: {cache.stats()['regime']}, "
                f"{cache.capacity_bytes / 1e9:.2f} GB of slots"
                + (" (preload skipped: it does not fit)" if preload is True else "")
            )
    if order not in ("auto", "block", "random"):
        raise ValueError(f"order must be 'auto', 'block' or 'random', got {order!r}")
    beyond_ram = cache is not None and not cache.in_ram
    if batch_sampler is not None:
        if hasattr(batch_sampler, "reason"):
            notes.append(f"sampler: {batch_sampler.reason}")
    elif sampler is None and shuffle and (order == "block" or (order == "auto" and beyond_ram)):
        sampler = make_sampler(dataset, order, seed=seed)
    elif sampler is None and shuffle:
        notes.append("sampler: shuffled over the whole dataset, a new order every epoch")
    if sampler is not None and hasattr(sampler, "reason"):
        notes.append(f"sampler: {sampler.reason}")
    sample = sample_bytes(dataset[0]) if len(dataset) else 0
    in_flight = int(IN_FLIGHT_SHARE * budget) if beyond_ram else 0
    ring = ring and hasattr(dataset, "batch_ring")
    plan = plan_loader(
        len(dataset), batch_size, workers, sample, budget, train, context, in_flight, pin_memory,
        ring,
    )  # fmt: skip
    if plan.ring:
        dataset.batch_ring = plan.prefetch_factor + 1
    if plan.num_workers:
        plan.context, why = start_method(context, dataset)
        notes.append(f"start method: {why}")
    plan.reasons += notes
    if batch_sampler is not None:
        loader = DataLoader(
            dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, **plan.kwargs()
        )
    else:
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=False if sampler is not None else shuffle,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            **plan.kwargs(),
        )
    if log:
        log(plan.log_block(name))
    return loader, plan


def sample_bytes(sample: Any) -> int:
    """Bytes of the tensors in one sample (a dict, tuple or tensor)."""
    if isinstance(sample, torch.Tensor):
        return sample.nbytes
    if isinstance(sample, dict):
        return sum(sample_bytes(v) for v in sample.values())
    if isinstance(sample, list | tuple):
        return sum(sample_bytes(v) for v in sample)
    return 0


def batch_len(batch: Any) -> int:
    """Samples in a collated batch (every zarrfeed batch carries ``item``)."""
    if isinstance(batch, dict):
        value = batch.get("item", next(iter(batch.values())))
        return len(value)
    return len(batch[0]) if isinstance(batch, list | tuple) else len(batch)
