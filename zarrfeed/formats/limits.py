"""Upper bounds on what a file can hold, checked before a reader allocates anything.

A header is a claim; the file size is a fact.  Readers compare the bytes a header promises
with the bytes the file has (or, compressed, could inflate to) and refuse the file first,
so a hostile or truncated header ends in an :class:`InputError`, never in a huge allocation.

A claim the file could honour may still be absurd: a 15 MB ``.nii.gz`` of zeros truly
inflates to 4 GiB.  :func:`require_allocatable` bounds every allocation a raw item causes by
what a plausible item of its family holds (:data:`PLAUSIBLE_BYTES`, configurable), and by
the memory this process can still get (RAM, its cgroup, its address-space limit), so such a
file fails naming itself, the claim and the bound instead of ``Unable to allocate``.
"""

from __future__ import annotations

import math
import os
import resource
from pathlib import Path
from typing import BinaryIO

import numpy as np

from zarrfeed.errors import InputError

# Deflate cannot expand more than 1032:1 (258-byte matches coded in 2 bits), so a gzip or
# zip member of n bytes inflates to at most 1032·n.
MAX_INFLATE_RATIO = 1032


def claimed_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of an array of ``shape`` in exact integers (no int64 overflow on 32767³)."""
    return math.prod(int(n) for n in shape) * int(itemsize)


def require_bytes(path: str | Path, needed: int, available: int, what: str) -> None:
    """Refuse ``path`` when ``what`` needs more bytes than the file can supply."""
    if needed > available:
        raise InputError(path, f"{needed} bytes for {what}", f"{available} bytes")


def require_inflatable(path: str | Path, needed: int, compressed: int, what: str) -> None:
    """Refuse ``path`` when ``needed`` bytes cannot inflate from ``compressed`` deflate bytes."""
    if needed > MAX_INFLATE_RATIO * compressed:
        raise InputError(
            path,
            f"{needed} bytes for {what}",
            f"{compressed} compressed bytes, which inflate to at most "
            f"{MAX_INFLATE_RATIO * compressed} bytes",
        )


def fill(f: BinaryIO, buf: np.ndarray, chunk: int = 16 << 20) -> int:
    """Read from ``f`` into ``buf`` (bytes) until it is full or the stream ends; the count.

    Chunked, so a stream whose ``readinto`` goes through ``read`` never holds a second copy.
    """
    view, got = memoryview(buf).cast("B"), 0
    while got < view.nbytes and (n := f.readinto(view[got : got + chunk])):
        got += n
    return got


GIB = 1 << 30
# The most bytes reading one raw item of each family may allocate, overridable with
# ZARRFEED_MAX_<FAMILY>_BYTES.  CT (the stored volume plus its float32 HU copy): CT-RATE
# scans are 512×512×(100–900) int16 (0.05–0.47 GB, 0.15–1.4 GB with the copy), a few
# 1024×1024×(250–900) (up to 1.9 GB, 5.7 GB with the copy); 6 GiB holds 1024²×1024 int16.
# Spike (one sequence array): a GoPro-spike sample is 360×640 × 137 frames (32 MB decoded),
# a SpikeZoo one 250×400 × 301 (30 MB); 4 GiB holds 800 samples of 5 bins at 1000×1000.
# Images (one set): a 16k×16k RGB image is 768 MB; 4 GiB holds ~340 2k×2k RGB images.
PLAUSIBLE_BYTES = {"ct": 6 * GIB, "spike": 4 * GIB, "images": 4 * GIB}


def plausible_bytes(family: str) -> int:
    """The bound of ``family`` (``ct``, ``spike``, ``images``), from the environment if set."""
    name = f"ZARRFEED_MAX_{family.upper()}_BYTES"
    value = os.environ.get(name)
    if value is None:
        return PLAUSIBLE_BYTES[family]
    try:
        return int(float(value))
    except ValueError:
        from zarrfeed.errors import ConfigError

        raise ConfigError(f"{name}={value!r}: expected a number of bytes") from None


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _self_vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def available_memory() -> int:
    """Bytes this process can still allocate: the least of the machine's available memory,
    what its cgroup (a container's memory limit) leaves, and what its address-space limit
    (``ulimit -v``) leaves."""
    bounds = [b for b in (_meminfo("MemAvailable"),) if b is not None]
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        bounds.append(max(limit - used, 0))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        bounds.append(max(soft - _self_vm_bytes(), 0))
    return min(bounds) if bounds else 1 << 62


def require_allocatable(path: str | Path, needed: int, what: str, family: str) -> None:
    """Refuse ``path`` before allocating ``needed`` bytes for ``what`` when that is more
    than a plausible ``family`` item takes or than this process can still get."""
    bound = plausible_bytes(family)
    if needed > bound:
        raise InputError(
            path,
            f"at most {bound} bytes for a plausible {family} item "
            f"(raise ZARRFEED_MAX_{family.upper()}_BYTES if it is real)",
            f"{needed} bytes for {what}",
        )
    free = available_memory()
    if needed > free:
        raise InputError(
            path, f"{needed} bytes of memory for {what}", f"{free} bytes available to this process"
        )
