"""Measuring loaders: throughput over real batches, a worker count tuned by measurement and
remembered, and one line of advice from the cache statistics."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from zarrfeed.processes import cpu_budget
from zarrfeed.training.data.base import collate_batch
from zarrfeed.training.data.loader import batch_len, collate_of
from zarrfeed.training.data.plan import LoaderPlan, plan_loader
from zarrfeed.training.data.protocols import StoreBacked
from zarrfeed.training.data.start import start_method


def autotune_file() -> Path:
    """Where measured worker counts are remembered (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "zarrfeed" / "autotune.json"


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


def recommend(plan: LoaderPlan, cache_stats: dict[str, Any], dataset_bytes: int) -> str:
    """One line of advice from a measured run."""
    advice = []
    if dataset_bytes > cache_stats["budget_bytes"] and cache_stats["hit_rate"] < 0.9:
        need = dataset_bytes / 1e9 * 1.05
        advice.append(f"raise cache_gb to {need:.3g} (hit rate {cache_stats['hit_rate']:.0%})")
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
    context: str = "auto",
    remember: Path | Literal["cache"] | None = "cache",
) -> LoaderPlan:
    """Measure candidate worker counts on real batches and keep the fastest, remembered per
    dataset and machine in ``remember`` ("cache": :func:`autotune_file`; None: not kept)."""
    if remember == "cache":
        remember = autotune_file()
    cpus, _ = cpu_budget()
    key = _tune_key(dataset, batch_size, cpus)
    saved = json.loads(remember.read_text()) if remember and remember.exists() else {}
    if key in saved:
        plan = LoaderPlan(**saved[key])
        plan.reasons.append("autotune: remembered for this dataset and machine")
        return plan
    results = {}
    context = start_method(context, dataset)[0]
    collate_fn = collate_of(dataset, collate_fn)
    for n in candidates or sorted({0, 1, cpus, max(1, cpus - 1)}):
        plan = plan_loader(len(dataset), batch_size, n, context=context)
        plan.shared_batches = collate_fn is collate_batch
        loader = DataLoader(
            dataset, batch_size=batch_size, shuffle=True, collate_fn=collate_fn, **plan.kwargs()
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
        dataset.cache.identity if isinstance(dataset, StoreBacked) else "",
        len(dataset),
        batch_size,
        platform.node(),
        cpus,
        torch.__version__,
    ]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]
