"""Upper bounds on what a file can hold, checked before a reader allocates anything.

A header is a claim; the file size is a fact.  Readers compare the bytes a header promises
with the bytes the file has (or, compressed, could inflate to) and refuse the file first,
so a hostile or truncated header ends in an :class:`InputError`, never in a huge allocation.
"""

from __future__ import annotations

import math
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
