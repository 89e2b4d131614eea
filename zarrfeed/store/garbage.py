"""Collection: what no commit record, and nothing the caller retains, names any more.

The store knows only its own records; what else keeps a version readable (a dataset version,
a live reader) is the caller's to say, as store path → retained versions
(:func:`zarrfeed.datasets.collect` says it for datasets).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zarrfeed.store import commits
from zarrfeed.store.backends import TEMPORARY
from zarrfeed.store.changes import now_ns
from zarrfeed.store.layout import META
from zarrfeed.store.records import summaries

if TYPE_CHECKING:
    from zarrfeed.store.zarrstore import ZarrStore

# Change-log hours kept: a reader whose last look is older scans in full.
CHANGES_KEPT_S = 7 * 86400.0


@dataclass
class Sweep:
    """What :meth:`ZarrStore.collect` removed, and the superseded versions it kept because
    the caller retains them."""

    removed: int = 0
    retained_versions: int = 0


def collect(store: ZarrStore, retained: Mapping[str, set[str]], older_than_s: float) -> Sweep:
    """:meth:`ZarrStore.collect`."""
    now = time.time()
    report = Sweep()
    for asset, keys in _version_folders(store):
        committed = {k: s["version"] for k, s in summaries(store, asset)[0].items()}
        keep = retained.get(asset, set())
        for key, names in keys.items():
            gone = [
                n for n in names
                if n != committed.get(key) and n not in keep
                and now - (commits.version_time(n) or now) >= older_than_s
            ]  # fmt: skip
            if gone and commits.committed_version(store, asset, key) in gone:
                gone.remove(commits.committed_version(store, asset, key))  # committed meanwhile
            for name in gone:
                store.remove_version(f"{store.path(asset, key)}/{name}")
            report.removed += len(gone)
            report.retained_versions += sum(
                1 for n in names if n in keep and n != committed.get(key)
            )
    cutoff = now_ns() - int(CHANGES_KEPT_S * 1e9)
    for asset in _logged_assets(store):
        report.removed += store.changes(asset).compact(cutoff)
    report.removed += _collect_temporaries(store, store.meta_path(), older_than_s)
    return report


def _logged_assets(store: ZarrStore, prefix: str = "") -> Iterator[str]:
    """Every asset with a change log."""
    folder = store.meta_path("changes", prefix) if prefix else store.meta_path("changes")
    names = store.backend.list_dir(folder)
    if prefix and any(n == "start.json" or n.isdigit() for n in names):
        yield prefix
        return
    for name in names:
        yield from _logged_assets(store, f"{prefix}/{name}" if prefix else name)


def _collect_temporaries(store: ZarrStore, folder: str, older_than_s: float) -> int:
    """Record files a local writer died while publishing (``<name>.<unix>-<id>.tmp``)."""
    removed, now = 0, time.time()
    for name in store.backend.list_dir(folder):
        path = f"{folder}/{name}"
        if not name.endswith(TEMPORARY):
            if "." not in name:
                removed += _collect_temporaries(store, path, older_than_s)
            continue
        stamp = name[: -len(TEMPORARY)].rsplit(".", 1)[-1].split("-", 1)[0]
        if stamp.isdigit() and now - int(stamp) >= older_than_s:
            store.backend.remove(path)
            removed += 1
    return removed


def _version_folders(
    store: ZarrStore, prefix: str = ""
) -> Iterator[tuple[str, dict[str, list[str]]]]:
    """(asset, key → its version names) of every asset with versions, committed or not."""
    backend = store.backend
    folder = backend.join(prefix) if prefix else store.root
    found: dict[str, list[str]] = {}
    for name in backend.list_dir(folder):
        if name in (META, "zarr.json") or commits.version_time(name) is not None:
            continue
        sub = f"{prefix}/{name}" if prefix else name
        children = backend.list_dir(backend.join(sub))
        versions = [c for c in children if commits.version_time(c) is not None]
        if versions and prefix:
            found[name] = versions
        elif children:
            yield from _version_folders(store, sub)
    if found:
        yield prefix, found
