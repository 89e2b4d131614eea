"""Content checksums of arrays: recorded when a partition is built, recomputed by
``zarrfeed verify``.  They hash the decoded values (dtype, shape and C-order bytes), so they
do not depend on codecs or chunking and catch a bit flipped anywhere between build and read.

They guard against corruption, not tampering (whoever can change the data can change the
recorded sum beside it), so the hash is XXH3-128: ~24 GB/s against SHA-256's ~1.6 GB/s
on one core, where hashing a CT scan's arrays at SHA-256 speed took ~5 % of a build's CPU.
Partitions built with the earlier SHA-256 sums are still verified with SHA-256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import xxhash


def _header(data: np.ndarray) -> bytes:
    return f"{data.dtype.str}{data.shape}".encode()


def array_xxh3_128(data: np.ndarray) -> str:
    h = xxhash.xxh3_128(_header(data))
    h.update(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return h.hexdigest()


def array_sha256(data: np.ndarray) -> str:
    h = hashlib.sha256(_header(data))
    h.update(np.ascontiguousarray(data).data)
    return h.hexdigest()


# The partition attribute (array name -> checksum) of each hash, the one written first.
HASHES: dict[str, Callable[[np.ndarray], str]] = {
    "array_xxh3_128": array_xxh3_128,
    "array_sha256": array_sha256,
}
ATTR = next(iter(HASHES))
array_checksum = HASHES[ATTR]


def recorded_checksums(
    attrs: Mapping[str, Any],
) -> tuple[Mapping[str, str], Callable[[np.ndarray], str]]:
    """The checksums a partition's attributes record (empty if none) and the hash they use."""
    for name, hash_ in HASHES.items():
        if name in attrs:
            return attrs[name] or {}, hash_
    return {}, array_checksum
