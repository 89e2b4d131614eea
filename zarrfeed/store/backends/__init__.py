"""Where the store's bytes live: one class per backend behind one small interface.

The store needs a handful of operations from storage — read one object, read many at once,
publish one object atomically, list a folder with change stamps, remove a tree — and a Zarr
store for the arrays.  :class:`LocalBackend` serves a folder on a local (or network) disk;
:class:`ObjectBackend` serves any fsspec filesystem (``s3://``, ``gs://``, ``memory://``).
Everything above (commits, manifests, chunk reads, the training cache) uses only this
interface, so it works the same on both.
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
