"""One loading plan: which tier serves the batches, in what order, with how many workers,
how much prefetch, how many intra-op threads and where the batches are placed, each with
its reason.

:func:`plan_loading` is pure: it reads facts gathered beforehand
(:mod:`~zarrfeed.training.data.facts`: of the dataset, of this machine, of the ``torchrun``
world, and the configured budgets) and returns a :class:`LoadingPlan`.  ``make_loader``,
the training feed and ``zarrfeed benchmark-loader`` gather those facts and carry the plan
out; none of them decides anything of its own, so one function says what loading does
and why, and its unit tests need no DataLoader.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

from zarrfeed.errors import ConfigError
from zarrfeed.training.data.device import PoolLayout, layout_pool
from zarrfeed.training.data.facts import (
    Budgets,
    CacheFacts,
    DataFacts,
    Machine,
    World,
    machine_facts,
    world_facts,
)
from zarrfeed.training.data.protocols import WorkerSettings
from zarrfeed.training.data.sampler import OrderPlan, choose_order
from zarrfeed.training.data.workers import init_worker

WORKER_OVERHEAD_BYTES = 300 << 20  # interpreter + torch + zarr per worker, measured ~250 MB
# Out of core, batches in flight live in shared memory beside the cache: they may add this
# share of its budget (the cache itself never exceeds it).
IN_FLIGHT_SHARE = 0.05
# Batches in shared memory besides the workers' prefetched ones: the one the training step
# holds and the one being handed to it (measured: 2 workers × prefetch 1 peak at 4 batches).
HELD_BATCHES = 2
# Share of the device's free memory the device cache may take by default ("auto").
DEVICE_SHARE = 0.25


# the plan -------------------------------------------------------------------------------------
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
    shared_batches: bool = False  # workers read batches straight into shared memory

    def kwargs(self) -> dict[str, Any]:
        pin = self.pin_memory and not self.ring
        kw: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": pin}
        if self.num_workers:
            slots = (self.prefetch_factor or 0) + 1 if self.ring else 0
            settings = WorkerSettings(slots, self.shared_batches)
            kw |= {
                "prefetch_factor": self.prefetch_factor,
                "persistent_workers": self.persistent_workers,
                "multiprocessing_context": self.context,
                "worker_init_fn": functools.partial(init_worker, os.getpid(), settings),
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


@dataclass
class LoadingPlan:
    """Everything :func:`plan_loading` chose.  ``tier``: "volumes" or "slots" (the device
    tier cuts the batches; ``device_budget`` bytes) or "loader" (a DataLoader over the host
    cache); ``order``: the epoch order (None: the caller's sampler, or none); ``threads``:
    intra-op threads to set (None: leave torch's).  The reasons, in the order the log
    prints them: the device, the workers, the cache, the sampler, the start method (known
    once the workers start) and the threads."""

    tier: str
    loader: LoaderPlan
    device_budget: int = 0
    preload: bool = False
    order: OrderPlan | None = None
    random_order: bool = False  # a plain loader's fresh shuffle per epoch
    threads: int | None = None
    device_reasons: list[str] = field(default_factory=list)
    worker_reasons: list[str] = field(default_factory=list)
    cache_reasons: list[str] = field(default_factory=list)
    order_reasons: list[str] = field(default_factory=list)
    start_reasons: list[str] = field(default_factory=list)
    thread_reasons: list[str] = field(default_factory=list)

    def reasons(self) -> list[str]:
        return [
            *self.device_reasons, *self.worker_reasons, *self.cache_reasons,
            *self.order_reasons, *self.start_reasons, *self.thread_reasons,
        ]  # fmt: skip


def plan_loading(data: DataFacts, machine: Machine, world: World, budgets: Budgets) -> LoadingPlan:
    """The loading plan for ``data`` on ``machine`` in ``world`` within ``budgets``."""
    tier, device_budget, device_reasons, layout = _plan_device(data, machine, budgets)
    if data.augment:  # where it runs, and why there
        device_reasons.append(
            f"{data.augment}: batched on {machine.device} after each gather, its scratch "
            f"({data.pool.augment / 1e6:.1f} MB per batch) within the device budget"
            if tier != "loader" and data.pool is not None
            else f"{data.augment}: per sample on the host as each is read, in the loader "
            "workers where there are any (the device cache does not cut these batches)"
        )
    feed = budgets.device_cache is not None
    cache = data.cache
    preload = cache is not None and cache.in_ram and budgets.preload in (True, "auto")
    if tier != "loader":
        order = _device_order(data, budgets, tier, layout)
        loader = LoaderPlan(0, None, False, False, None)
        return LoadingPlan(
            tier, loader, device_budget, preload, order,
            device_reasons=device_reasons,
            cache_reasons=[_preload_line(cache)] if preload else [],
            order_reasons=[
                f"sampler: {order.reason}",
                "batches are cut on the device by one gather, prepared a step ahead: no workers",
            ],
        )  # fmt: skip
    cache_reasons = []
    if cache is not None:
        fits = _fits(cache)
        if preload:
            cache_reasons.append(_preload_line(cache))
        elif cache.in_ram:
            cache_reasons.append(f"cache: {fits}: filled on demand")
        else:
            cache_reasons.append(
                f"cache: {fits}: {cache.regime}, {cache.capacity_bytes / 1e9:.2f} GB of slots"
                + (" (preload skipped: it does not fit)" if budgets.preload is True else "")
            )
    if budgets.order not in ("auto", "block", "random"):
        raise ValueError(f"order must be 'auto', 'block' or 'random', got {budgets.order!r}")
    beyond_ram = cache is not None and not cache.in_ram
    order, random_order, order_reasons = None, False, []
    if feed:  # the feed's chain walks a resumable order of its own
        order = choose_order(budgets.order, cache and cache.order_facts(), data.name)
    elif budgets.given_sampler is not None:
        if budgets.given_sampler:
            order_reasons.append(f"sampler: {budgets.given_sampler}")
    elif budgets.shuffle and (budgets.order == "block" or (budgets.order == "auto" and beyond_ram)):
        order = choose_order(budgets.order, cache and cache.order_facts(), data.name)
    elif budgets.shuffle:
        random_order = True
        order_reasons.append("sampler: shuffled over the whole dataset, a new order every epoch")
    if order is not None:
        order_reasons.append(f"sampler: {order.reason}")
    ring = data.worker_configurable and (data.hands_on if feed else budgets.ring)
    in_flight = int(IN_FLIGHT_SHARE * cache.budget_bytes) if beyond_ram else 0
    loader = plan_loader(
        data.samples, budgets.batch_size, budgets.workers, data.sample_bytes,
        cache.budget_bytes if cache is not None else 0, budgets.train, budgets.context,
        in_flight, budgets.pin_memory, ring, machine, world,
    )  # fmt: skip
    loader.shared_batches = data.hands_on
    threads, thread_reasons = None, []
    if feed and machine.device_type == "cpu":
        threads, line = plan_threads(machine, world, loader.num_workers)
        thread_reasons.append(line)
    return LoadingPlan(
        "loader", loader, 0, preload, order, random_order, threads, device_reasons,
        list(loader.reasons), cache_reasons, order_reasons, [], thread_reasons,
    )  # fmt: skip


def _fits(cache: CacheFacts) -> str:
    return f"{cache.nbytes / 1e9:.2f} GB decoded, cache budget {cache.budget_bytes / 1e9:.2f} GB"


def _preload_line(cache: CacheFacts | None) -> str:
    """The preload's reason; its executor adds how long it took (:func:`preloaded`)."""
    assert cache is not None
    return f"cache: preloaded {_fits(cache)}"


def preloaded(plan: LoadingPlan, seconds: float) -> None:
    """Record in ``plan`` how long the preload it asked for took."""
    plan.cache_reasons = [
        f"{r} in {seconds:.1f}s" if r.startswith("cache: preloaded ") else r
        for r in plan.cache_reasons
    ]


def started(plan: LoadingPlan, why: str) -> None:
    """Record in ``plan`` the start method its workers use (resolved against the caller's
    ``__main__`` once there are workers to start: :func:`~.start.start_method`)."""
    plan.start_reasons = [f"start method: {why}"]


# the device tier ------------------------------------------------------------------------------
def device_budget(machine: Machine, configured_gb: float | None) -> tuple[int, str]:
    """Bytes the device cache may take: as configured, else ``DEVICE_SHARE`` of the free
    device memory (of the available RAM on the CPU)."""
    if configured_gb is not None:
        return int(configured_gb * (1 << 30)), f"{configured_gb:g} GiB as configured"
    if machine.device_type == "cuda":
        free = machine.device_free
        where = f"{free / 1e9:.1f} GB free on {machine.device}"
        return int(DEVICE_SHARE * free), f"{DEVICE_SHARE:g} x {where}"
    free = machine.available_memory
    return int(DEVICE_SHARE * free), f"{DEVICE_SHARE:g} x {free / 1e9:.1f} GB available RAM"


def _plan_device(
    data: DataFacts, machine: Machine, budgets: Budgets
) -> tuple[str, int, list[str], PoolLayout | None]:
    """(tier, budget, reasons, slot pool layout) for ``budgets.device_cache`` ("auto": on
    CUDA only; "on": on any device; "off"; None: a plain loader, no device tier).

    The dataset's volumes go to the device when they fit its budget; otherwise a pool of
    slots within the budget holds the units the batches read, as long as one batch's units
    fit; otherwise batches come from the DataLoader."""
    mode, device = budgets.device_cache, machine.device
    if mode is None:
        return "loader", 0, [], None
    if mode == "off":
        return "loader", 0, ["device cache: off (as configured)"], None
    if data.device_refusal is not None:
        why = data.device_refusal
        return "loader", 0, [f"device cache: off ({why})"], None
    if mode == "auto" and machine.device_type != "cuda":
        return "loader", 0, [f"device cache: off (auto: {device} is not a CUDA device)"], None
    assert data.cache is not None and data.pool is not None
    budget, how = device_budget(machine, budgets.device_cache_gb)
    size, scratch = data.cache.nbytes, data.pool.augment
    if size + scratch <= budget:
        extra = f" + {scratch / 1e6:.1f} MB augment scratch" if scratch else ""
        line = f"device cache: volumes held on {device} ({size / 1e9:.2f} GB{extra} <= {how})"
        return "volumes", budget, [line], None
    layout = layout_pool(data.pool, budget, budgets.batch_size)
    need = layout.need
    if layout.slots < need or not data.pool.uniform:
        why = (
            "scans have different cache units"
            if not data.pool.uniform
            else f"a batch may need {need} units, the rest of the budget holds {layout.slots} "
            f"({layout.describe()})"
        )
        return "loader", 0, [f"device cache: off ({size / 1e9:.2f} GB > {how}; {why})"], None
    line = (
        f"device cache: a pool on {device} within {how} ({size / 1e9:.2f} GB do not fit): "
        f"{layout.describe()}; units uploaded from the host cache ahead of the step, "
        "least recently used evicted"
    )
    return "slots", budget, [line], layout


def _device_order(
    data: DataFacts, budgets: Budgets, tier: str, layout: PoolLayout | None
) -> OrderPlan:
    """The epoch order when the device cuts the batches: a block shuffle sized to the
    smaller of the slot pool and the host cache when units stream through slots, else a
    shuffle of the whole dataset (or the block order asked for)."""
    cache = data.cache
    assert cache is not None
    if layout is not None and budgets.order == "auto":  # units stream through slots
        pool = layout.slot_total
        host = cache.capacity_bytes or pool
        block = min(host, pool) // 2
        return OrderPlan(
            "block",
            f"block shuffle: partitions in blocks of <= {block / 1e9:.3f} GB of cache units "
            f"(half the smaller of the {pool / 1e9:.3f} GB of device slots and the "
            f"{host / 1e9:.3f} GB host cache), shuffled within each block; the device slots "
            "hold this block's units in one half and the next block's, uploaded a few per "
            "batch while this one trains, in the other",
            block,
        )
    if budgets.order == "block":
        return choose_order("block", cache.order_facts(), data.name)
    where = "on the device" if tier == "volumes" else "in device slots"
    shuffle = choose_order("random", None)
    return replace(shuffle, reason=f"{shuffle.reason} (the batches are cut {where})")


# workers and threads --------------------------------------------------------------------------
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
    machine: Machine | None = None,
    world: World | None = None,
) -> LoaderPlan:
    """The DataLoader settings: ``workers`` ("auto", "cpu*0.9", N) resolved against
    ``machine`` (None: this one, :func:`machine_facts`), ``world`` (None: :func:`world_facts`)
    and the dataset; ``in_flight_bytes`` (when set) bounds the shared memory of the batches
    in flight; ``pin_memory``: whether batches go to a CUDA device (None: whether CUDA is
    present); ``ring``: workers reuse batch slots that the consumer frees (:mod:`.ring`)."""
    machine = machine_facts() if machine is None else machine
    world = world_facts() if world is None else world
    cpus, ranks = machine.cpus, world.local
    reasons = [f"CPUs usable: {cpus} ({machine.cpus_how}); local world size: {ranks}"]
    batches = max(1, math.ceil(dataset_len / batch_size))
    reasons.append(f"dataset: {dataset_len} samples, batch {batch_size} -> {batches} batches")
    per_rank = max(1, cpus // ranks)
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
        n = max(1, math.floor(cpus * share / ranks))
        reasons.append(f"workers: {n} from {spec} = {share:g} x {cpus} CPUs / {ranks} ranks")
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
        room = machine.available_memory - cache_bytes
        per_worker = WORKER_OVERHEAD_BYTES + (prefetch or 0) * batch_size * sample_bytes
        fit = max(0, room // per_worker)
        if fit < n:
            n = int(fit)
            reasons.append(
                f"capped at {n}: {room >> 20} MiB free after the cache, "
                f"{per_worker >> 20} MiB per worker"
            )
    pin = machine.cuda if pin_memory is None else pin_memory
    if n and in_flight_bytes and sample_bytes:
        fit_in = _fit_ring if ring else _fit_in_flight
        n, prefetch = fit_in(n, prefetch or 0, batch_size * sample_bytes, in_flight_bytes,
                             pin, reasons)  # fmt: skip
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
    n: int, prefetch: int, batch: int, room: int, pinned: bool, reasons: list[str]
) -> tuple[int, int]:
    """(workers, prefetch) whose batches in flight — ``n`` × ``prefetch`` prefetched, the
    held ones, one more pinned copy with CUDA — fit in ``room`` bytes of shared memory;
    :class:`ConfigError` in one line, with the smallest budget that works, when not even one
    worker with one batch fits."""
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
    """:func:`_fit_in_flight` for workers with batch rings: each holds ``prefetch + 1``
    slots (the one being copied out besides its prefetched ones), and one pinned copy with
    CUDA, within ``room``; nothing else is shared."""
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


def plan_threads(machine: Machine, world: World, workers: int) -> tuple[int | None, str]:
    """(intra-op threads to set, or None to leave them; the reason) when the model trains on
    the CPU: this rank's share of the CPUs less its loader workers.  torch's default, a
    thread per CPU in every rank, spins against the workers and whatever else runs: on 2
    CPUs with 1 worker and other processes busy, 60 defect-segmentation steps took 58 s on 2
    threads and 27 s on 1.  ``OMP_NUM_THREADS``, when set, wins."""
    if machine.omp_threads:
        return None, f"intra-op threads: {machine.torch_threads} (OMP_NUM_THREADS)"
    cpus, ranks = machine.cpus, world.local
    want = max(1, cpus // ranks - workers)
    threads = want if want < machine.torch_threads else None
    return threads, (
        f"intra-op threads: {threads or machine.torch_threads} (the model trains on the CPU: "
        f"{cpus} CPUs, {ranks} rank(s) here, {workers} loader workers each)"
    )
