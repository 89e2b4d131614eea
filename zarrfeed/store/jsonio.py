"""JSON for commit records, record indexes and manifests, fast enough for 50,000 partitions.

orjson parses and writes several times faster than the standard library, which is what a
manifest over 200,000 commit records or a 100 MB dataset manifest costs.  Commit records are
written by ``json.dumps`` and may hold ``NaN``/``Infinity``, which orjson refuses to parse:
those go through the standard library.  What :func:`dumps` writes (indexes and manifests) is
sizes, shapes, names, hashes and times, never a non-finite number, which orjson would write as
``null``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

from zarrfeed.store.bulk import gc_paused


def loads(data: bytes | str) -> Any:
    """A JSON document; one holding ``NaN`` or ``Infinity`` is parsed by the standard library."""
    # A manifest is millions of new dicts and lists, none of them garbage.
    with gc_paused():
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            return json.loads(data)


def dumps(obj: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """Compact JSON bytes of ``obj``; the standard library's where orjson cannot write it
    (keys that are not strings, integers beyond 64 bits)."""
    try:
        return orjson.dumps(obj, default=default)
    except TypeError:
        return json.dumps(obj, separators=(",", ":"), default=default).encode()


def named(path: str, data: bytes) -> Any:
    """The JSON document ``data`` read from ``path``; a damaged one is named."""
    from zarrfeed.errors import StoreError

    try:
        return loads(data)
    except ValueError as exc:  # json's and orjson's decode errors are ValueErrors
        raise StoreError(
            f"{path}: not a readable JSON document ({exc}); the file is damaged: rebuild "
            "what it records"
        ) from None
