"""Helpers shared by the benchmark scripts: timing and the BENCH line format."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """Fastest of ``repeat`` wall-clock runs, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench(name: str, value: float, unit: str, text: str = "") -> None:
    """Print one result as ``BENCH <name> <value> <unit> <free text>``."""
    print(f"BENCH {name} {value:.4g} {unit} {text}".rstrip(), flush=True)


def ratio(name: str, ours: float, baseline: float, text: str = "") -> None:
    bench(name, baseline / ours, "x", f"zarrfeed={ours:.4g}s baseline={baseline:.4g}s {text}")
