"""Upper bounds on what a file can hold, checked before a reader allocates anything.

A header is a claim; the file size is a fact.  Readers compare the bytes a header promises
with the bytes the file has (or, compressed, could inflate to) and refuse the file first,
so a hostile or truncated header ends in an :class:`InputError`, never in a huge allocation.

A claim the file could honour may still be absurd: a 15 MB ``.nii.gz`` of zeros truly
inflates to 4 GiB.  :func:`require_allocatable` bounds every allocation a raw item causes by
what a plausible item of its family holds (a :class:`Bound` its reader or its family
declares, configurable), and by the memory this process can still get (RAM, its cgroup, its
address-space limit), so such a file fails naming itself, the claim and the bound instead
of ``Unable to allocate``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from zarrfeed.errors import InputError
from zarrfeed.processes import available_memory

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


@dataclass(frozen=True)
class Bound:
    """The most bytes reading one raw item of ``family`` may allocate, overridable with
    ``ZARRFEED_MAX_<FAMILY>_BYTES``."""

    family: str
    nbytes: int

    @property
    def variable(self) -> str:
        return f"ZARRFEED_MAX_{self.family.upper()}_BYTES"

    def value(self) -> int:
        text = os.environ.get(self.variable)
        if text is None:
            return self.nbytes
        try:
            return int(float(text))
        except ValueError:
            from zarrfeed.errors import ConfigError

            raise ConfigError(f"{self.variable}={text!r}: expected a number of bytes") from None


# The volume readers' bound (NIfTI, DICOM series, .npy/.npz volumes), CT's: the stored volume
# plus its float32 HU copy.  CT-RATE scans are 512×512×(100–900) int16 (0.05–0.47 GB,
# 0.15–1.4 GB with the copy), a few 1024×1024×(250–900) (up to 1.9 GB, 5.7 GB with the
# copy); 6 GiB holds 1024²×1024 int16.
VOLUMES = Bound("ct", 6 * GIB)


def require_allocatable(path: str | Path, needed: int, what: str, bound: Bound = VOLUMES) -> None:
    """Refuse ``path`` before allocating ``needed`` bytes for ``what`` when that is more
    than a plausible item within ``bound`` takes or than this process can still get."""
    most = bound.value()
    if needed > most:
        raise InputError(
            path,
            f"at most {most} bytes for a plausible {bound.family} item "
            f"(raise {bound.variable} if it is real)",
            f"{needed} bytes for {what}",
        )
    free = available_memory()
    if needed > free:
        raise InputError(
            path, f"{needed} bytes of memory for {what}", f"{free} bytes available to this process"
        )
