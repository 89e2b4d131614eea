"""Consolidated tables: one partition that concatenates an asset's rows over a dataset's
keys, so a loader over 10,000 partitions opens one group instead of 10,000."""

from __future__ import annotations

from typing import Any

import numpy as np

from zarrfeed.errors import StoreError
from zarrfeed.store import ZarrStore
from zarrfeed.store.layout import dataset_path


def consolidate(
    store: ZarrStore,
    dataset: str,
    asset: str,
    keys: list[str],
    arrays: list[str],
    versions: list[str] | None = None,
    *,
    table: str,
) -> dict[str, Any]:
    """Concatenate ``arrays`` of ``asset`` over ``keys`` into one partition for training.

    Written as partition ``table`` of the dataset's tables (``layout.dataset_path``) with an
    ``offsets`` array (rows of key ``i`` are ``offsets[i]:offsets[i+1]``).  Incremental: the
    rows of a key whose committed version is the one the previous consolidation read are
    taken from it, so only rebuilt or new partitions are read; with nothing changed,
    nothing is written.  ``versions``: the version of each key to read (a dataset
    manifest's), by default the committed ones.
    """
    part = table
    if versions is None:
        found = store.record_summaries(asset)
        missing = [k for k in keys if k not in found]
        if missing:
            raise StoreError(f"no committed partitions {missing[:5]} of {asset!r} in {store.url}")
        versions = [found[k]["version"] for k in keys]
    table = dataset_path(dataset)
    seen, at, rows = _previous(store, table, part, asset, arrays)
    if at is not None and list(seen.items()) == list(zip(keys, versions, strict=False)):
        return {"rows": rows, "keys": len(keys)}
    offsets = store.read_array(table, part, "offsets", at) if at else np.zeros(1, np.int64)
    tables = {name: store.read_array(table, part, name, at) for name in arrays} if at else {}
    index = {k: i for i, k in enumerate(seen)}
    parts: dict[str, list[np.ndarray]] = {name: [] for name in arrays}
    counts = []
    for key, version in zip(keys, versions, strict=True):
        if seen.get(key) == version:
            lo, hi = offsets[index[key]], offsets[index[key] + 1]
            for name in arrays:
                parts[name].append(tables[name][lo:hi])
        else:
            for name in arrays:
                parts[name].append(store.read_array(asset, key, name, version))
        counts.append(len(parts[arrays[0]][-1]))
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    attrs = {"source_asset": asset, "keys": keys, "versions": versions}
    with store.write_partition(table, part, attrs) as w:
        w.write("offsets", offsets, read="whole")
        for name, chunks in parts.items():
            w.write(name, np.concatenate(chunks) if chunks else np.zeros(0), read="rows")
    return {"rows": int(offsets[-1]), "keys": len(keys)}


def _previous(
    store: ZarrStore, table: str, part: str, asset: str, arrays: list[str]
) -> tuple[dict[str, str], str | None, int]:
    """(key → the version it was read at, the consolidation's own version, its rows) of the
    committed consolidation of ``asset`` in ``table``; ({}, None, 0) when there is none to
    reuse."""
    if not store.has_partition(table, part):
        return {}, None, 0
    record = store.commit_record(table, part)
    attrs = record["attrs"]
    if attrs.get("source_asset") != asset or set(arrays) - set(record["arrays"]):
        return {}, None, 0  # another asset's, or other arrays
    rows = int(record["arrays"][arrays[0]]["shape"][0]) if arrays else 0
    return dict(zip(attrs["keys"], attrs["versions"], strict=True)), record["version"], rows
