"""Where things live under a store's root, besides the asset groups themselves.

<asset>/<key>/<version>/...                 a partition's versions (``zarrstore``)
datasets/<name>/<table>/...                 a dataset's consolidated tables
.zarrfeed/commits/<asset>/<key>.json        commit records
.zarrfeed/changes/<asset>/                  the asset's log of commit intents (``changes``)
.zarrfeed/indexes/<asset>.json              commit-record summaries
.zarrfeed/manifests/<name>.json             dataset manifests training consumes
.zarrfeed/manifests/<name>.rows             the same as rows, for the next manifest (``rows``)
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


def catalog_path(family: str) -> str:
    return meta("catalog", family)
