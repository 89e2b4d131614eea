"""Dataset manifests: what training reads of the committed partitions, and where it is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zarrfeed.datasets.rows import asset_summary
from zarrfeed.datasets.snapshots import Snapshots
from zarrfeed.errors import StoreError
from zarrfeed.store import ZarrStore
from zarrfeed.store.keys import check_asset
from zarrfeed.store.layout import dataset_path, manifest_path, snapshot_path
from zarrfeed.store.records import PROVENANCE


def snapshots(store: ZarrStore) -> Snapshots:
    """The dataset versions of ``store``."""
    return Snapshots(store.backend, store.url)


def build_manifest(
    store: ZarrStore, asset: str, keys: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    """Counts, shapes, dtypes and bytes of committed partitions of ``asset``: what training
    reads.

    ``keys`` limits it to those partitions (default: every committed one).  Each
    partition names its version, so a reader of the manifest reads exactly what it
    lists or fails loudly.
    """
    found = store.record_summaries(asset)
    keys = list(found) if keys is None else keys
    missing = [k for k in keys if k not in found]
    if missing:
        raise StoreError(f"no committed partitions {missing[:5]} of {asset!r} in {store.url}")
    return _manifest(asset, store.url, [found[k] for k in keys], extra)


def read_manifest(store: ZarrStore, name: str, version: str | None = None) -> dict[str, Any]:
    """The manifest of version ``version`` of dataset ``name`` (default: its current
    version); a version past retention fails naming it and the retention."""
    return snapshots(store).read(check_asset(name), version)


def manifest_url(store: ZarrStore, name: str, version: str | None = None) -> str:
    """Where the manifest of version ``version`` of dataset ``name`` is (default: its
    current version), to show to a person."""
    version = version or (snapshots(store).pointer(check_asset(name)) or {}).get("id")
    return f"{store.url}/{snapshot_path(name, version) if version else manifest_path(name)}"


def pinned_versions(manifest: Mapping[str, Any]) -> dict[str, set[str]]:
    """Store path → the versions a dataset manifest names (its partitions and tables)."""
    out = {path: {p["version"] for p in a["partitions"]} for path, a in manifest["assets"].items()}
    tables = dataset_path(manifest["dataset"])
    out.setdefault(tables, set()).update((manifest.get("tables") or {}).values())
    return out


def entry(summary: dict[str, Any], provenance: bool) -> dict[str, Any]:
    """A manifest's partition: key, version, arrays (shape, dtype, chunks, nbytes: the
    summary's own dicts, not copies), stored bytes, and perhaps the provenance."""
    out = {k: summary[k] for k in ("key", "version", "arrays", "stored_bytes")}
    if provenance:
        out |= {k: summary["attrs"].get(k) for k in PROVENANCE}
    return out


def _manifest(
    asset: str,
    url: str,
    records: list[dict[str, Any]],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of one asset over commit-record summaries, with each partition's source,
    hash, code version and fingerprint."""
    arrays: dict[str, dict[str, Any]] = {}
    for r in records:
        for name, a in r["arrays"].items():
            found = arrays.setdefault(name, {"dtypes": set(), "shapes": set(), "nbytes": 0})
            found["dtypes"].add(a["dtype"])
            found["shapes"].add(tuple(a["shape"]))
            found["nbytes"] += a["nbytes"]
    stored = sum(r["stored_bytes"] for r in records)
    totals = {
        n: (e["dtypes"], [list(s) for s in e["shapes"]], e["nbytes"]) for n, e in arrays.items()
    }
    return {
        **asset_summary(asset, url, len(records), stored, totals),
        "partitions": [entry(r, provenance=True) for r in records],
        **extra,
    }
