"""Content checksums of arrays: recorded when a partition is built, recomputed by
``zarrfeed verify``.  They hash the decoded values (dtype, shape and C-order bytes), so they
do not depend on codecs or chunking and catch a bit flipped anywhere between build and read."""

from __future__ import annotations

import hashlib

import numpy as np

ATTR = "array_sha256"  # the partition attribute: array name -> checksum


def array_sha256(data: np.ndarray) -> str:
    h = hashlib.sha256(f"{data.dtype.str}{data.shape}".encode())
    h.update(np.ascontiguousarray(data).data)
    return h.hexdigest()
