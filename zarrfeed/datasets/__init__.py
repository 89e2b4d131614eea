"""Datasets over the store: manifests as immutable, retained versions of the keys that make
one sound sample, their consolidated tables, and the readers' leases that keep them.

Every function takes the :class:`~zarrfeed.store.ZarrStore` first; the store knows nothing
of datasets.
"""

from zarrfeed.datasets.collection import Collection, collect
from zarrfeed.datasets.leases import Lease
from zarrfeed.datasets.manifest import (
    build_manifest,
    manifest_url,
    pinned_versions,
    read_manifest,
    snapshots,
)
from zarrfeed.datasets.plan import DatasetPlan, plan_dataset
from zarrfeed.datasets.snapshots import Retention
from zarrfeed.datasets.tables import consolidate
from zarrfeed.datasets.versions import (
    dataset_versions,
    open_dataset,
    publish_dataset,
    write_dataset,
)

__all__ = [
    "Collection",
    "DatasetPlan",
    "Lease",
    "Retention",
    "build_manifest",
    "collect",
    "consolidate",
    "dataset_versions",
    "manifest_url",
    "open_dataset",
    "pinned_versions",
    "plan_dataset",
    "publish_dataset",
    "read_manifest",
    "snapshots",
    "write_dataset",
]
