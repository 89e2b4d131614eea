"""Reading a partition's arrays: through its commit record, from one version only.

An array of the committed version is opened from the ``zarr.json`` its record holds (no GET
of it), and on an object store from one listing of the version's objects (a chunk never
written costs no GET); a version removed meanwhile fails the read loudly, where a Zarr group
opened before would read the removed chunks as fill values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from zarrfeed.errors import StoreError
from zarrfeed.store.chunkio import ChunkedArray
from zarrfeed.store.keys import check_key

# zarr (~0.3 s) is imported where an array is opened: a code location that declares the
# stores without reading one (every run and step process loads one) does without it.
if TYPE_CHECKING:
    import zarr

    from zarrfeed.store.zarrstore import ZarrStore

LISTINGS_KEPT = 4096  # version listings a store keeps (each a set of its object paths)


def open_partition(
    store: ZarrStore, asset: str, key: str, version: str | None = None
) -> zarr.Group:
    """:meth:`ZarrStore.open_partition`."""
    import zarr

    folder = store.version_path(asset, key, version)
    if version is not None and not store.backend.exists(f"{folder}/zarr.json"):
        raise StoreError(
            f"version {version} of partition {asset}/{key} is gone from {store.url}: it was "
            "rebuilt or deleted and then collected, as no retained dataset version or live "
            "reader named it"
        )
    return zarr.open_group(store.backend.zarr_store(folder, read_only=True), mode="r")


def open_array(
    store: ZarrStore, asset: str, key: str, name: str, version: str | None = None
) -> zarr.Array:
    """:meth:`ZarrStore.open_array`."""
    import zarr

    folder = store.version_path(asset, key, version)
    zstore = store.backend.zarr_store(folder, read_only=True)
    try:
        return zarr.open_array(zstore, path=check_key(name), mode="r", zarr_format=3)
    except FileNotFoundError:  # zarr's NodeNotFoundError is one: the array or its version
        if not store.backend.exists(f"{folder}/zarr.json"):
            raise StoreError(
                f"version {folder.rsplit('/', 1)[-1]} of partition {asset}/{key} is gone "
                f"from {store.url}: it was rebuilt or deleted since it was looked up (for "
                "a version a dataset manifest lists: rebuilt after the manifest was "
                "written; rebuild the dataset manifest); read it again"
            ) from None
        group = zarr.open_group(zstore, mode="r")
        arrays = sorted(group.array_keys())
        raise StoreError(f"partition {asset}/{key} has no array {name!r}: {arrays}") from None
    except OSError as exc:
        raise store.backend.failure("read", f"{folder}/{name}/zarr.json", exc) from None


def chunked(
    store: ZarrStore, asset: str, key: str, name: str, version: str | None = None
) -> ChunkedArray:
    """:meth:`ZarrStore.chunked`."""
    listed, array = None, None
    if version is None:
        record = store.commit_record(asset, key)
        version = record["version"]
        listed = _listing(store, store.version_path(asset, key, version), record)
        array = recorded_array(store, record, asset, key, name)
    folder = store.version_path(asset, key, version)
    if array is None:
        array = store.open_array(asset, key, name, version)
    return ChunkedArray(array, store.backend, f"{folder}/{name}", f"{folder}/zarr.json",
                        store.tier, store.identity, listed)  # fmt: skip


def recorded_array(
    store: ZarrStore, record: dict[str, Any], asset: str, key: str, name: str
) -> zarr.Array | None:
    """Array ``name`` of the version ``record`` commits, opened from the ``zarr.json``
    the record holds (no GET of it); None where the record holds none (written by an
    older zarrfeed, or no such array): then the array's own metadata is read.  A record
    whose copy disagrees with its own shape, dtype or chunks is refused."""
    import zarr
    from zarr.storage import StorePath

    summary = record["arrays"].get(name)
    meta = summary.get("zarr_json") if isinstance(summary, dict) else None
    if meta is None:
        return None
    folder = store.version_path(asset, key, record["version"])
    path = f"{folder}/{check_key(name)}"
    try:
        zstore = store.backend.zarr_store(folder, read_only=True)
        array = zarr.Array(zarr.AsyncArray(meta, StorePath(zstore, name)))
    except (TypeError, ValueError, KeyError) as exc:
        raise StoreError(f"{path}: the commit record's zarr.json is invalid ({exc})") from None
    if (
        list(array.shape) != summary["shape"]
        or str(array.dtype) != summary["dtype"]
        or list(array.chunks) != summary["chunks"]
    ):
        raise StoreError(
            f"{path}: the commit record's zarr.json ({array.dtype} {array.shape}, chunks "
            f"{array.chunks}) disagrees with the record ({summary['dtype']} "
            f"{summary['shape']}, chunks {summary['chunks']}): rebuild the partition"
        )
    return array


def _listing(store: ZarrStore, folder: str, record: dict[str, Any]) -> frozenset[str] | None:
    """Every object path of the committed version in ``folder``, from one listing on an
    object store (a chunk never written then costs no GET): only when the listed bytes
    add up to the ``stored_bytes`` its commit record counted, so a listing that lags
    the writes is never taken for fill values; else None (every chunk is then read).
    Kept per version: a committed version never changes."""
    stored = record.get("stored_bytes")
    if store.local or not isinstance(stored, int):
        return None
    found = store.listings.get(folder)
    if found is None:
        sizes = store.backend.sizes(folder)
        if sum(sizes.values()) != stored:
            return None
        if len(store.listings) >= LISTINGS_KEPT:
            store.listings.clear()
        found = store.listings[folder] = frozenset(sizes)
    return found


def read_partition(
    store: ZarrStore, asset: str, key: str, names: list[str], version: str | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """:meth:`ZarrStore.read_partition`."""
    if version is None:
        record = store.commit_record(asset, key)
        version, attrs = record["version"], record["attrs"]
    else:
        attrs = dict(store.open_partition(asset, key, version).attrs)
    return {n: store.read_array(asset, key, n, version) for n in names}, attrs
