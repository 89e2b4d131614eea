"""The next version of a dataset: which keys make one sound sample, before it is published.

Kept as rows (:mod:`zarrfeed.datasets.rows`) beside the dataset's pointer, so the next plan
reads only the keys its assets' change logs name since the last one; without usable rows or
logs it is built from every asset's record summaries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zarrfeed.datasets.manifest import entry
from zarrfeed.datasets.rows import DatasetRows
from zarrfeed.datasets.rules import changed_settings, mixed_builds, mixed_settings
from zarrfeed.store import ZarrStore
from zarrfeed.store.bulk import gc_paused
from zarrfeed.store.changes import now_ns
from zarrfeed.store.contract import StoredAsset, failed_checks
from zarrfeed.store.keys import check_asset
from zarrfeed.store.records import covered, next_position, summaries, summarise


@dataclass(frozen=True)
class DatasetPlan:
    """The next version of a dataset before it is published (:func:`plan_dataset`)."""

    name: str
    rows: DatasetRows

    @property
    def keys(self) -> list[str]:
        return sorted(self.rows.rows)

    def versions(self, asset: str) -> list[str]:
        """The version of each key's partition of ``asset``, in the order of :attr:`keys`."""
        return self.rows.versions(asset)


def rows_path(store: ZarrStore, name: str) -> str:
    """Where the rows of dataset ``name``'s current version are kept."""
    return store.meta_path("manifests", f"{check_asset(name)}.rows")


@gc_paused()  # 200,000 summaries and manifest entries, none of them garbage
def plan_dataset(
    store: ZarrStore,
    name: str,
    assets: list[str],
    withheld: Mapping[str, list[str]] | None = None,
    lineage: Sequence[StoredAsset] = (),
    settings: Mapping[str, Any] | None = None,
) -> DatasetPlan:
    """The next version of dataset ``name``, not yet visible: the keys committed in all
    of ``assets`` whose partitions passed every blocking check and make one sample.

    Keys present in only some assets (a partition still building, or one that failed to
    build) are listed as ``incomplete``, keys with a partition that failed a check as
    ``failed``; both are left out, so readers never meet half a sample or bad data.
    ``withheld`` (key → reasons) leaves out committed keys whose data is sound but whose
    source is in doubt (two raw items now claim the key), listed under ``failed`` too.
    ``lineage``: the stored assets whose dependencies a key's partitions must agree on
    (:func:`~zarrfeed.datasets.rules.mixed_builds`); a key that mixes two builds of a
    stage is left out under ``failed``, naming the stage to build again; so is a key
    built with another value of a setting its readers take per dataset than the
    dataset's (:func:`~zarrfeed.datasets.rules.mixed_settings`: the ``settings`` now,
    where any key was built with them, else the most common value).
    The plan's keys and pinned versions are what the dataset's tables are built from
    before :func:`~zarrfeed.datasets.versions.publish_dataset` makes it the current version.
    """
    held = {k: list(v) for k, v in (withheld or {}).items()}
    rows = _updated_rows(store, name, assets, held, lineage, settings) or _full_rows(
        store, assets, held, lineage, settings
    )
    return DatasetPlan(name, rows)


def _full_rows(
    store: ZarrStore,
    assets: list[str],
    withheld: dict[str, list[str]],
    lineage: Sequence[StoredAsset],
    settings: Mapping[str, Any] | None = None,
) -> DatasetRows:
    """:func:`plan_dataset`'s rows from every asset's record summaries."""
    found = {a: summaries(store, a) for a in assets}
    records = {a: out for a, (out, _) in found.items()}
    committed = {a: set(out) for a, out in records.items()}
    candidates = sorted(set.intersection(*committed.values())) if committed else []
    rows = DatasetRows(assets)
    for a, out in records.items():
        for k in candidates:
            bad = failed_checks(out[k])
            if bad:
                rows.failed.setdefault(k, []).extend(f"{a}:{n}" for n in bad)
    for k in candidates if lineage else ():
        mixed = mixed_builds(lineage, {a: records[a][k] for a in assets})
        if mixed:
            rows.failed.setdefault(k, []).extend(mixed)
    sound = [k for k in candidates if k not in rows.failed and k not in withheld]
    samples = {k: {a: records[a][k] for a in assets} for k in sound} if lineage else {}
    for k, mixed in mixed_settings(lineage, samples, settings).items():
        rows.failed.setdefault(k, []).extend(mixed)
    for k, reasons in withheld.items():
        if k in candidates:
            rows.failed.setdefault(k, []).extend(reasons)
    for k in candidates:
        if k not in rows.failed:
            rows.add(k, [entry(records[a][k], provenance=False) for a in assets])
    rows.incomplete = set().union(*committed.values()) - set(candidates)
    rows.positions = {a: after for a, (_, after) in found.items()}
    rows.withheld = withheld
    return rows


def _updated_rows(
    store: ZarrStore,
    name: str,
    assets: list[str],
    withheld: dict[str, list[str]],
    lineage: Sequence[StoredAsset],
    settings: Mapping[str, Any] | None = None,
) -> DatasetRows | None:
    """The previous rows of dataset ``name`` with the keys its assets' change logs name
    since then read again (a key withheld or released counts as changed); None when
    there are no such rows or a log does not cover the time since."""
    looked = now_ns()
    try:
        rows = DatasetRows.parse(store.backend.read(rows_path(store, name)), assets, store.url)
    except FileNotFoundError:
        return None
    if rows is None:
        return None
    known = bool(rows.positions)
    logs = {a: covered(store, a, rows.positions.get(a), looked, known) for a in assets}
    if any(intents is None for intents in logs.values()):
        return None
    changed = {i.key for intents in logs.values() for i in intents}
    before = rows.withheld
    changed |= {k for k in before.keys() | withheld.keys() if before.get(k) != withheld.get(k)}
    fresh = {
        a: {k: summarise(r) for k, r in store.commit_records(a, sorted(changed)).items() if r}
        for a in assets
    }
    samples = {
        k: {a: fresh[a][k] for a in assets} for k in changed if all(k in fresh[a] for a in assets)
    }
    kept = next((k for k in rows.rows if k not in changed), None)
    if kept is not None and any(spec.per_dataset for spec in lineage):
        reference = {a: summarise(store.commit_record(a, kept)) for a in assets}
    else:
        reference = None
    settled = changed_settings(lineage, reference, samples, settings, rows.failed)
    if settled is None:
        return None  # the dataset's value of a per-dataset setting may change: judge all
    for k in sorted(changed):
        rows.leave_out(k)
        present = [a for a in assets if k in fresh[a]]
        if len(present) < len(assets):
            if present:
                rows.incomplete.add(k)
            continue
        bad = [f"{a}:{n}" for a in assets for n in failed_checks(fresh[a][k])]
        bad += mixed_builds(lineage, {a: fresh[a][k] for a in assets})
        bad += settled.get(k, [])
        if bad or k in withheld:
            rows.failed[k] = bad + withheld.get(k, [])
            continue
        rows.add(k, [entry(fresh[a][k], provenance=False) for a in assets])
    rows.positions = {a: next_position(looked, logs[a], fresh[a]) for a in assets}
    rows.withheld = withheld
    return rows
