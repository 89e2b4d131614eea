"""DataLoaders that size themselves: workers from the CPUs this process may use, the local
world size, the dataset size and the memory budget; the choice is logged with its reasons."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

WORKER_OVERHEAD_BYTES = 300 << 20  # interpreter + torch + zarr per worker, measured ~250 MB
AUTOTUNE_FILE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zarrfeed" / "autotune.json"
)


def usable_cpus() -> tuple[int, str]:
    """CPUs this process may use: affinity, capped by a cgroup v2 CPU quota; and how."""
    affinity = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            limit = max(1, math.floor(int(quota) / int(period)))
            if limit < affinity:
                return limit, f"cgroup quota {quota}/{period} (affinity {affinity})"
    except (OSError, ValueError):
        pass
    return affinity, f"sched_getaffinity ({os.cpu_count()} on the host)"


def available_memory() -> int:
    """MemAvailable in bytes (Linux); the total physical memory elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers:
            kw |= {
                "prefetch_factor": self.prefetch_factor,
                "persistent_workers": self.persistent_workers,
                "multiprocessing_context": self.context,
                "worker_init_fn": _one_thread,
            }
        return kw

    def log_block(self, name: str = "train") -> str:
        """The configuration in one block, like seed 001's training log."""
        lines = [
            f"[{name}] ========== data loading configuration ==========",
            *[f"[{name}] {r}" for r in self.reasons],
        ]
        lines.append(
            f"[{name}] num_workers={self.num_workers} prefetch_factor={self.prefetch_factor} "
            f"pin_memory={self.pin_memory} persistent_workers={self.persistent_workers} "
            f"context={self.context}"
        )
        return "\n".join(lines)


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)  # workers run side by side; intra-op threads would oversubscribe


def plan_loader(
    dataset_len: int,
    batch_size: int,
    workers: int | str = "auto",
    sample_bytes: int = 0,
    cache_bytes: int = 0,
    train: bool = True,
    context: str = "forkserver",
) -> LoaderPlan:
    """Resolve ``workers`` ("auto", "cpu*0.9", N) against this machine and dataset."""
    cpus, how = usable_cpus()
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
            share = 0.8  # seed 001: "auto" = 80 % of the CPUs, leaving room for the main process
        elif spec.startswith("cpu*"):
            share = float(spec[4:])
        else:
            raise ValueError(
                f"workers must be 'auto', 'cpu*<fraction>' or an integer, got {workers!r}"
            )
        n = max(1, math.floor(cpus * share / world))
        reasons.append(f"workers: {n} from {spec} = {share:g} x {cpus} CPUs / {world} ranks")
        # Seed 000: few samples per worker make worker start-up and cache warm-up dominate.
        small = 2 if dataset_len < 50 else 4 if dataset_len < 200 else None
        if small is not None and n > small:
            n = small
            reasons.append(f"capped at {small}: small dataset ({dataset_len} samples; seed 000)")
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
    cuda = torch.cuda.is_available()
    reasons.append("pinned memory: " + ("on (CUDA present)" if cuda else "off (no CUDA)"))
    return LoaderPlan(n, prefetch if n else None, cuda, n > 0, context if n else None, reasons)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    workers: int | str = "auto",
    shuffle: bool = True,
    preload: bool | str = "auto",
    collate_fn: Callable | None = None,
    sampler: Any = None,
    drop_last: bool = False,
    train: bool = True,
    context: str = "forkserver",
    log: Callable[[str], None] | None = print,
    name: str = "train",
) -> tuple[DataLoader, LoaderPlan]:
    """A DataLoader over ``dataset`` with a planned configuration, preloading its cache when
    the whole dataset fits the budget (``preload="auto"``)."""
    collate_fn = collate_fn or getattr(dataset, "collate", None)
    cache = getattr(dataset, "cache", None)
    budget = cache.budget_bytes if cache is not None else 0
    total = dataset.nbytes() if hasattr(dataset, "nbytes") else 0
    if cache is not None and (preload is True or (preload == "auto" and 0 < total <= budget)):
        t0 = time.perf_counter()
        dataset.preload()
        preloaded = (
            f"preloaded {total / 1e9:.2f} GB into the shared cache in "
            f"{time.perf_counter() - t0:.1f}s (budget {budget / 1e9:.2f} GB)"
        )
    else:
        preloaded = (
            f"cache: {budget / 1e9:.2f} GB budget, dataset {total / 1e9:.2f} GB: "
            "filled on demand (LRU)"
        )
    sample = sample_bytes(dataset[0]) if len(dataset) else 0
    plan = plan_loader(len(dataset), batch_size, workers, sample, budget, train, context)
    if cache is not None:
        plan.reasons.append(preloaded)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle if sampler is None else False,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        **plan.kwargs(),
    )
    if log:
        log(plan.log_block(name))
    return loader, plan


@dataclass
class LoaderReport:
    """Throughput of a loader over some batches: what ``benchmark-loader`` prints."""

    samples_per_s: float
    batch_mean_ms: float
    batch_std_ms: float
    first_batch_s: float
    batches: int


def measure(loader: DataLoader, batches: int) -> LoaderReport:
    """Time ``batches`` batches (after the first, which pays worker start-up)."""
    it = iter(loader)
    t0 = time.perf_counter()
    next(it)
    first = time.perf_counter() - t0
    times, samples = [], 0
    for _ in range(batches):
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        times.append(time.perf_counter() - t)
        samples += batch_len(batch)
    total = sum(times)
    return LoaderReport(
        samples / total if total else 0.0,
        1000 * statistics.fmean(times),
        1000 * (statistics.pstdev(times) if len(times) > 1 else 0.0),
        first,
        len(times),
    )


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


def recommend(plan: LoaderPlan, cache_stats: dict[str, Any], dataset_bytes: int) -> str:
    """One line of advice from a measured run."""
    advice = []
    if dataset_bytes > cache_stats["budget_bytes"] and cache_stats["hit_rate"] < 0.9:
        need = dataset_bytes / 1e9 * 1.05
        advice.append(f"raise cache_gb to {need:.1f} (hit rate {cache_stats['hit_rate']:.0%})")
    if plan.num_workers == 0:
        advice.append("use workers='auto': loading runs in the training process")
    if not advice:
        advice.append(f"keep {plan.num_workers} workers; run with --autotune to compare others")
    return "; ".join(advice)


def autotune(
    dataset: Dataset,
    batch_size: int,
    candidates: list[int] | None = None,
    batches: int = 20,
    collate_fn: Callable | None = None,
    context: str = "forkserver",
    remember: Path | None = AUTOTUNE_FILE,
) -> LoaderPlan:
    """Measure candidate worker counts on real batches and keep the fastest, remembered per
    dataset and machine (``~/.cache/zarrfeed/autotune.json``)."""
    cpus, _ = usable_cpus()
    key = _tune_key(dataset, batch_size, cpus)
    saved = json.loads(remember.read_text()) if remember and remember.exists() else {}
    if key in saved:
        plan = LoaderPlan(**saved[key])
        plan.reasons.append("autotune: remembered for this dataset and machine")
        return plan
    results = {}
    for n in candidates or sorted({0, 1, cpus, max(1, cpus - 1)}):
        plan = plan_loader(len(dataset), batch_size, n, context=context)
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            collate_fn=collate_fn or getattr(dataset, "collate", None),
            **plan.kwargs(),
        )
        results[n] = (measure(loader, batches).samples_per_s, plan)
        del loader
    best = max(results, key=lambda n: results[n][0])
    plan = results[best][1]
    plan.reasons.append(
        "autotune: " + ", ".join(f"{n} workers {v[0]:.0f}/s" for n, v in sorted(results.items()))
    )
    if remember:
        remember.parent.mkdir(parents=True, exist_ok=True)
        saved[key] = asdict(plan)
        remember.write_text(json.dumps(saved, indent=1))
    return plan


def _tune_key(dataset: Dataset, batch_size: int, cpus: int) -> str:
    what = [
        type(dataset).__name__,
        getattr(dataset, "url", ""),
        len(dataset),
        batch_size,
        platform.node(),
        cpus,
        torch.__version__,
    ]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]
