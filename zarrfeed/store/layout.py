"""Where things live under a store's root, besides the asset groups themselves.

<asset>/<key>/<version>/...                 a partition's versions (``commits``)
datasets/<name>/<table>/...                 a dataset's consolidated tables
.zarrfeed/commits/<asset>/<key>.json        commit records
.zarrfeed/changes/<asset>/                  the asset's log of commit intents (``changes``)
.zarrfeed/indexes/<asset>.json              commit-record summaries (``records``)
.zarrfeed/manifests/<name>.json             a dataset's pointer: its current version and retention
.zarrfeed/snapshots/<name>/<id>.json        dataset versions: immutable manifests (datasets)
.zarrfeed/leases/<lease>.json               live readers of a dataset version (datasets)
.zarrfeed/manifests/<name>.rows             the same as rows, for the next manifest (datasets)
.zarrfeed/catalog/<family>/                 the raw-item catalog, and the build queue
"""

from __future__ import annotations

META = ".zarrfeed"  # everything that is not an asset's data
DATASETS = "datasets"


def meta(*parts: str) -> str:
    """A path under the store's bookkeeping folder, relative to the root."""
    return "/".join((META, *parts))


def dataset_path(name: str) -> str:
    """The store path of dataset ``name``'s tables (each a partition of it)."""
    return f"{DATASETS}/{name}"


def manifest_path(name: str) -> str:
    return meta("manifests", f"{name}.json")


def snapshot_path(name: str, snapshot: str | None = None) -> str:
    """The folder of dataset ``name``'s versions, or version ``snapshot``'s manifest."""
    folder = meta("snapshots", name)
    return folder if snapshot is None else f"{folder}/{snapshot}.json"


def catalog_path(family: str) -> str:
    return meta("catalog", family)
