"""Collection of a store with its datasets: dataset versions past retention go, and the
partition versions the retained ones and live readers name are kept from the store's sweep."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from zarrfeed.datasets.leases import live
from zarrfeed.datasets.manifest import pinned_versions, snapshots
from zarrfeed.errors import StoreError
from zarrfeed.store import ZarrStore
from zarrfeed.store.changes import MARGIN_S
from zarrfeed.store.commits import VERSION_GRACE_S


@dataclass
class Collection:
    """What :func:`collect` removed and kept."""

    removed: int = 0
    leases: int = 0  # live readers' leases
    retained_versions: int = 0  # superseded partition versions a dataset version still names
    kept: dict[str, str] = field(default_factory=dict)  # "<dataset>@<id>" -> why it is kept
    expired: list[str] = field(default_factory=list)  # dataset versions past retention

    def describe(self) -> str:
        kept = "; ".join(f"{k} ({why})" for k, why in self.kept.items()) or "none"
        return (
            f"removed {self.removed} objects ({len(self.expired)} dataset versions past "
            f"retention); kept {self.retained_versions} superseded partition versions for "
            f"dataset versions {kept}; {self.leases} live readers"
        )


def collect(store: ZarrStore, older_than_s: float = VERSION_GRACE_S) -> Collection:
    """Remove what nothing retains: dataset versions past their retention, then what
    :meth:`ZarrStore.collect` removes with the partition versions of every retained dataset
    version and live reader's lease kept.  Returns what it removed and what it kept, and
    why."""
    now = time.time()
    leases = live(store.backend, now)
    leased = {(lease["dataset"], lease["snapshot"]) for lease in leases}
    report = Collection(leases=len(leases))
    protected: dict[str, set[str]] = {}
    window = min(older_than_s, MARGIN_S)
    found = snapshots(store)
    for name in found.datasets():
        mine = {s for d, s in leased if d == name}
        why, expired = found.retained(name, now, mine, window)
        for snapshot in expired:
            found.remove(name, snapshot)
            report.removed += 1
            report.expired.append(f"{name}@{snapshot}")
        for snapshot, reason in why.items():
            try:
                manifest = found.read(name, snapshot)
            except StoreError:
                continue  # removed meanwhile by another collector
            report.kept[f"{name}@{snapshot}"] = reason
            for path, versions in pinned_versions(manifest).items():
                protected.setdefault(path, set()).update(versions)
    sweep = store.collect(retained=protected, older_than_s=older_than_s)
    report.removed += sweep.removed
    report.retained_versions = sweep.retained_versions
    return report
