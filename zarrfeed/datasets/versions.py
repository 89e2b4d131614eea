"""Dataset versions: publishing a plan as an immutable snapshot, opening one under a lease,
and listing the stored versions with the bytes each retains."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any

from zarrfeed.datasets.leases import Lease
from zarrfeed.datasets.manifest import read_manifest, snapshots
from zarrfeed.datasets.plan import DatasetPlan, plan_dataset, rows_path
from zarrfeed.datasets.snapshots import Retention
from zarrfeed.errors import StoreError, ZarrfeedError
from zarrfeed.store import ZarrStore
from zarrfeed.store.bulk import gc_paused
from zarrfeed.store.changes import MARGIN_S
from zarrfeed.store.commits import json_default
from zarrfeed.store.contract import StoredAsset
from zarrfeed.store.layout import dataset_path, snapshot_path


def write_dataset(
    store: ZarrStore,
    name: str,
    assets: list[str],
    withheld: Mapping[str, list[str]] | None = None,
    lineage: Sequence[StoredAsset] = (),
    settings: Mapping[str, Any] | None = None,
    retention: Retention | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """:func:`~zarrfeed.datasets.plan.plan_dataset` and :func:`publish_dataset`, for a
    dataset without tables."""
    plan = plan_dataset(store, name, assets, withheld, lineage, settings)
    return publish_dataset(store, plan, retention=retention, **extra)


@gc_paused()
def publish_dataset(
    store: ZarrStore,
    plan: DatasetPlan,
    tables: Mapping[str, Any] | None = None,
    retention: Retention | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Make ``plan`` the current version of its dataset, with ``tables`` (table name →
    its facts: partitions of ``layout.dataset_path(name)`` written for the plan) pinned
    at their committed versions; returns the manifest, with its ``id``.

    A version is a snapshot (:mod:`zarrfeed.datasets.snapshots`): it names exact partition
    and table versions, and whatever opens it reads those until it closes, while
    partitions are rebuilt, deleted or collected.  A plan with the same content as the
    current version keeps its id.  Partitions carry what reading needs (key, version,
    arrays, bytes), not their provenance: training parses this manifest at start,
    50,000 partitions of four assets at a time; provenance is in the commit records.
    """
    name, rows, facts = plan.name, plan.rows, dict(tables or {})
    records = store.commit_records(dataset_path(name), sorted(facts)) if facts else {}
    pins = {t: r["version"] for t, r in records.items() if r is not None}
    digest = rows.digest(facts)
    extra = {k: v for k, v in extra.items() if k not in ("id", "created_unix", "tables")}

    def write(head: dict[str, Any]) -> bytes:
        return rows.manifest(name, store.url, {**extra, **head}, json_default)[0]

    head = snapshots(store).publish(name, digest, pins, retention or Retention(), write)
    manifest = rows.manifest(name, store.url, {**extra, **head}, json_default)[1]
    with suppress(ZarrfeedError, OSError):  # older rows only mean more records to read
        store.backend.write_atomic(rows_path(store, name), rows.dumps(store.url))
    return manifest


def open_dataset(
    store: ZarrStore, name: str, version: str | None = None
) -> tuple[dict[str, Any], Lease]:
    """The manifest of a dataset version and a lease that keeps it from collection until
    released.  The lease is taken right after the manifest is read, within the window
    collection keeps a just-superseded version for; if it came late, the version is checked
    again."""
    begun = time.time()
    manifest = read_manifest(store, name, version)
    lease = Lease(store.backend, name, manifest["id"])
    if time.time() - begun > MARGIN_S / 2 and not store.backend.exists(
        store.backend.join(snapshot_path(name, manifest["id"]))
    ):
        lease.release()
        raise StoreError(f"version {manifest['id']} of dataset {name!r} was collected "
                         "while being opened: open it again")  # fmt: skip
    return manifest, lease


def dataset_versions(store: ZarrStore, name: str) -> list[dict[str, Any]]:
    """Every stored version of dataset ``name``, oldest first: id, created, keys, the
    bytes its partitions hold, and the bytes no other version or commit holds."""
    committed: dict[str, set[str]] = {}
    out, seen = [], set()
    found = snapshots(store)
    pointer = found.pointer(name) or {}
    for snapshot in found.ids(name):
        try:
            manifest = read_manifest(store, name, snapshot)
        except StoreError:
            continue  # collected meanwhile
        stored = retained = 0
        for path, asset in manifest["assets"].items():
            if path not in committed:
                summaries = store.record_summaries(path)
                committed[path] = {s["version"] for s in summaries.values()}
            for p in asset["partitions"]:
                stored += p["stored_bytes"]
                if p["version"] not in committed[path] and (path, p["version"]) not in seen:
                    retained += p["stored_bytes"]
                    seen.add((path, p["version"]))
        out.append({
            "id": snapshot,
            "created_unix": manifest.get("created_unix"),
            "keys": len(manifest["keys"]),
            "stored_bytes": stored,
            "retained_bytes": retained,
            "current": snapshot == pointer.get("id"),
        })  # fmt: skip
    return out
