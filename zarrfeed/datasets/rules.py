"""The mixed-build rule: which keys' partitions do not make one sample of a dataset.

A key enters a dataset only when every stage of it was built from the builds of its
upstream stages committed now, and with the dataset's value of each setting its readers take
once per dataset (``StoredAsset.per_dataset``); the others are left out, naming the stage to
build again, so training never pairs arrays of two volumes or two settings.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from zarrfeed.store.contract import StoredAsset, plain, upstream_changed


def mixed_builds(
    lineage: Sequence[StoredAsset], summaries: Mapping[str, Mapping[str, Any] | None]
) -> list[str]:
    """Why a key's partitions (``summaries``: store path → its record summary) do not make
    one sample: a stage built from another build of a stage it reads than the one committed
    now (the scan changed, its first stages were rebuilt and a later one failed) pairs
    arrays of two volumes until it is built again.  ``lineage``: the stored assets whose
    dependencies are followed; partitions that do not record what they were built from are
    taken as they are."""
    attrs = {s.name: (summaries.get(s.path) or {}).get("attrs") or {} for s in lineage}
    return [
        f"{spec.name} was built from another build of {up}: build it again"
        for spec in lineage
        for up in upstream_changed(spec, attrs[spec.name], attrs)
    ]


# Part of every reason :func:`mixed_settings` gives, so that a dataset's previous verdicts
# can be told apart (:func:`changed_settings`).
PER_DATASET = "which readers take per dataset"


def built_with(
    lineage: Sequence[StoredAsset], summaries: Mapping[str, Mapping[str, Any] | None]
) -> dict[tuple[str, str], Any]:
    """(stage name, setting) → the value one key's partitions (``summaries``: store path →
    record summary) were built with, for each per-dataset setting of ``lineage``; a
    partition that records no such value (none yet, or built before) has none."""
    out = {}
    for spec in lineage:
        params = ((summaries.get(spec.path) or {}).get("attrs") or {}).get("params") or {}
        out |= {(spec.name, p): params[p] for p in spec.per_dataset if p in params}
    return out


def mixed_settings(
    lineage: Sequence[StoredAsset],
    samples: Mapping[str, Mapping[str, Mapping[str, Any] | None]],
    current: Mapping[str, Any] | None = None,
) -> dict[str, list[str]]:
    """Key → why it is left out of a dataset of the keys ``samples`` (key → store path →
    record summary): one of its partitions was built with another value of a setting its
    readers take once per dataset (``StoredAsset.per_dataset``) than the dataset's.

    The dataset's value is the ``current`` settings' when any key was built with it (what
    was asked for wins, and the others are named to be rebuilt), else the most common one
    (ties: the smallest as JSON), so the dataset never shrinks to nothing while the settings
    point at a value not built yet.  Partitions that record no value are taken as they are.
    """
    if not any(spec.per_dataset for spec in lineage):
        return {}
    values = {k: built_with(lineage, s) for k, s in samples.items()}
    counts: dict[tuple[str, str], Counter[str]] = {}
    for found in values.values():
        for setting, value in found.items():
            counts.setdefault(setting, Counter())[_json(value)] += 1
    chosen = {}
    for (stage, name), seen in counts.items():
        wanted = _json(current[name]) if current is not None and name in current else None
        chosen[(stage, name)] = wanted if wanted in seen else min(seen, key=lambda v: (-seen[v], v))
    return {k: why for k, found in values.items() if (why := _differ(found, chosen))}


def changed_settings(
    lineage: Sequence[StoredAsset],
    kept: Mapping[str, Mapping[str, Any] | None] | None,
    samples: Mapping[str, Mapping[str, Mapping[str, Any] | None]],
    current: Mapping[str, Any] | None,
    failed: Mapping[str, Sequence[str]],
) -> dict[str, list[str]] | None:
    """:func:`mixed_settings` for the keys ``samples`` that changed since a dataset's
    previous manifest, judged against ``kept``: the summaries of a key that manifest kept and
    that did not change (every key it kept was built with the same values); ``failed`` is
    why it left keys out.  None when the dataset's value of a setting may change, so every
    key must be judged again: no such key, or one that records no value; or the kept value
    is not the ``current`` one and a changed key has another value or keys were left out for
    another value (which now could be the most common)."""
    if not any(spec.per_dataset for spec in lineage):
        return {}
    if kept is None:
        return None
    reference = built_with(lineage, kept)
    if len(reference) < sum(len(spec.per_dataset) for spec in lineage):
        return None
    values = {k: built_with(lineage, s) for k, s in samples.items()}
    chosen = {setting: _json(value) for setting, value in reference.items()}
    earlier = any(PER_DATASET in why for reasons in failed.values() for why in reasons)
    for (stage, name), value in chosen.items():
        if current is not None and name in current and _json(current[name]) == value:
            continue  # the current value, kept: it stays the dataset's whatever changed
        others = any(_json(v.get((stage, name), value)) != value for v in values.values())
        if earlier or others:
            return None
    return {k: why for k, found in values.items() if (why := _differ(found, chosen))}


def _differ(
    found: Mapping[tuple[str, str], Any], chosen: Mapping[tuple[str, str], str]
) -> list[str]:
    return [
        f"{stage} was built with {name}={_json(value)}, {PER_DATASET}, and the dataset's is "
        f"{chosen[(stage, name)]}: build {stage} again"
        for (stage, name), value in found.items()
        if _json(value) != chosen[(stage, name)]
    ]


def _json(value: Any) -> str:
    """A setting's value as canonical JSON (lists and tuples alike), to compare and show."""
    return json.dumps(plain(value), sort_keys=True)
