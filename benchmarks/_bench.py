"""Helpers shared by the benchmark scripts: timing and the BENCH line format."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """Fastest of ``repeat`` wall-clock runs, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def touch_memory(gib: float) -> float:
    """Write ``gib`` GiB once and free it; returns the seconds it took.

    On a fresh VM the first write to a guest page costs about ten times a later one (the
    hypervisor backs it then), and a process's new arrays get such
    pages until the machine has used its memory once.  A side that runs first would pay that
    and the other not; after this both sides allocate from pages already backed, as on a
    node that has been running for a while.
    """
    t0 = time.perf_counter()
    block = np.empty(int(gib * (1 << 30)), dtype=np.uint8)
    block[::4096] = 1  # one write per page is enough to have it backed
    del block
    return time.perf_counter() - t0


def bench(name: str, value: float, unit: str, text: str = "") -> None:
    """Print one result as ``BENCH <name> <value> <unit> <free text>``."""
    print(f"BENCH {name} {value:.4g} {unit} {text}".rstrip(), flush=True)


def ratio(name: str, ours: float, baseline: float, text: str = "") -> None:
    bench(name, baseline / ours, "x", f"zarrfeed={ours:.4g}s baseline={baseline:.4g}s {text}")


class GpuUtilisation:
    """Mean GPU utilisation (NVML: share of time a kernel was running), sampled every
    ``every`` seconds between :meth:`start` and :meth:`stop`; ``mean`` stays None where
    NVML is missing (CPU machines)."""

    def __init__(self, index: int = 0, every: float = 0.05) -> None:
        self.index, self.every, self.mean = index, every, None
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception:  # no NVML: nothing to sample
            return
        self._thread = threading.Thread(target=self._run, args=(pynvml, handle), daemon=True)
        self._thread.start()

    def _run(self, pynvml, handle) -> None:
        while not self._stop.wait(self.every):
            self._samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self._samples:
                self.mean = sum(self._samples) / len(self._samples) / 100
