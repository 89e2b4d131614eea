"""Where the store's bytes live: one class per backend behind one small interface.

The store needs a handful of operations from storage — read one object, read many at once,
publish one object atomically, list a folder with change stamps, remove a tree — and a Zarr
store for the arrays.  :class:`LocalBackend` serves a folder on a local (or network) disk;
:class:`ObjectBackend` serves any fsspec filesystem (``s3://``, ``gs://``, ``memory://``).
Everything above (commits, manifests, chunk reads, the training cache) uses only this
interface, so it works the same on both.

The arrays go through zarr's own ``Store`` (:meth:`Backend.zarr_store`).  The bookkeeping
does not: zarr's ``Store`` is asynchronous, lacks what the commit protocol needs (a write
that is atomic and durable before a record names it, listings with change stamps, folder
keys some object stores keep), and where it covers an operation it is slower from
synchronous code — measured on a 2-core machine, 2,000 records of 600 bytes: a folder
listing 0.8 ms here against 34 ms through ``LocalStore`` (7 against 20 ms on
``memory://``), 200 single reads 2.1 against 301 ms, 2,000 concurrent reads 122 against
624 ms (30 against 514 ms on ``memory://``); removing a tree of 1,000 files takes the same
(121 against 128 ms) but only through zarr's private synchronous bridge.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zarrfeed.store.backends.base import Backend
from zarrfeed.store.backends.errors import redact
from zarrfeed.store.backends.local import TEMPORARY, LocalBackend, write_file_atomic
from zarrfeed.store.backends.objectstore import ObjectBackend


def open_backend(url: str | Path, storage_options: dict[str, Any] | None = None) -> Backend:
    """The backend for a folder or an fsspec URL."""
    text = str(url)
    if "://" not in text or text.startswith("file://"):
        return LocalBackend(text.removeprefix("file://"))
    return ObjectBackend(text, storage_options)


__all__ = [
    "TEMPORARY",
    "Backend",
    "LocalBackend",
    "ObjectBackend",
    "open_backend",
    "redact",
    "write_file_atomic",
]
