"""``zarrfeed status`` : per family, the partitions that are missing,
stale, failed, running or without a raw source, each with the command that fixes it.

Out of date has one meaning here, the nightly schedule's
(:meth:`zarrfeed.families.Family.out_of_date` over ``zarrfeed.store.contract.stale_reason``),
judged with the settings of the family's component, as the nightly judges it: ``status`` and
the nightly never disagree.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zarrfeed.commands.options import existing_store, families, reader_options
from zarrfeed.commands.output import human_bytes, print_json, print_table
from zarrfeed.datasets import dataset_versions
from zarrfeed.errors import root_cause
from zarrfeed.families import Family
from zarrfeed.store.contract import failed_checks

LAUNCH = "dg launch -m zarrfeed.definitions --job {job} --partition {key}"
STATES = ("missing", "stale", "failed", "running", "conflict", "no source")  # the table's columns
# The catalog and every partition's provenance name a source by its absolute path.
RESTORE = (
    "put it back where it was (the catalog records absolute paths), or drop a source deleted "
    "on purpose: zarrfeed partitions remove {family} {key}"
)


@dataclass
class Entry:
    """Partitions of a family in one state, and what to do about them."""

    family: str
    state: str  # missing | stale | failed | running | no source | conflict | unreadable
    keys: list[str]
    why: str
    fix: str

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def family_status(
    declared: Family,
    store: Any,
    catalog: Any,
    settings: Mapping[str, Any],
    partition_keys: list[str] | None,
    partition_states: Mapping[str, str],
) -> tuple[int, list[Entry]]:
    """(partitions, entries) of ``family``; ``partition_keys`` are the instance's (None
    without an instance: the catalog's), ``partition_states`` key → ``running`` or the root
    cause of its last failed run, from the instance."""
    family = declared.name
    index = catalog.index()
    keys = sorted(partition_keys if partition_keys is not None else index)
    job = declared.build_job
    entries: list[Entry] = []

    def add(state: str, found: list[str], why: str, fix: str) -> None:
        if found:
            entries.append(Entry(family, state, sorted(found), why, fix))

    running = [k for k, s in partition_states.items() if s == "running"]
    failed_runs = {k: s for k, s in partition_states.items() if s != "running" and k in index}
    reasons = declared.out_of_date(store, settings, keys, index)
    unsourced = missing_sources(index, keys)
    busy = {*running, *failed_runs, *(k for found in unsourced.values() for k in found)}
    missing = {k: w for k, w in reasons.items() if w.endswith("missing") and k not in busy}
    stale = {k: w for k, w in reasons.items() if k not in missing and k not in busy}
    add("missing", list(missing), "never built", _launch(declared, missing))
    for why in sorted(set(stale.values())):
        group = [k for k, w in stale.items() if w == why]
        add("stale", group, why, _launch(declared, group))
    add("running", running, "a run is building it", "wait, or watch it in the UI (dg dev)")
    records = {a.name: store.commit_records(a.path, keys) for a in declared.assets}
    bad_checks = {
        k: [f"{a}:{c}" for a, r in records.items() for c in failed_checks(r.get(k))] for k in keys
    }
    for key, checks in sorted(bad_checks.items()):
        if checks and key not in reasons and key not in failed_runs:
            add("failed", [key], "checks failed: " + ", ".join(checks), "fix its raw source, then "
                + LAUNCH.format(job=job, key=key))  # fmt: skip
    for key, cause in sorted(failed_runs.items()):
        if not index[key].conflict:
            add("failed", [key], cause, "fix the cause, then " + LAUNCH.format(job=job, key=key))
    conflicts = [k for k in keys if k in index and index[k].conflict]
    for key in conflicts:
        item = index[key]
        add("conflict", [key], f"{item.location} and {', '.join(item.conflict)} claim this key",
            "rename one of the files (until then the key is left out of the dataset)")  # fmt: skip
    for origin, skipped in sorted(catalog.skipped().items()):
        add("unreadable", list(skipped), "discovery skipped these raw entries: "
            + "; ".join(f"{p}: {why}" for p, why in list(skipped.items())[:5]),
            f"fix or remove them under {origin.removeprefix('raw:')}")  # fmt: skip
    for why, found in unsourced.items():
        key = found[0] if len(found) == 1 else "KEY"
        add("no source", found, why, RESTORE.format(family=family, key=key))
    gone = [k for k in keys if k not in index]
    for key in gone:
        add("no source", [key], "no raw item in the catalog (never discovered, or deleted)",
            f"zarrfeed partitions remove {family} {key}")  # fmt: skip
    return len(keys), entries


def missing_sources(index: Mapping[str, Any], keys: list[str]) -> dict[str, list[str]]:
    """What is missing (a whole raw folder, or one item's file) → the partitions it leaves
    without a source: the catalog still lists them, so nothing else would notice."""
    from zarrfeed.sources.raw import missing_source

    out: dict[str, list[str]] = {}
    for key in keys:
        why = missing_source(index[key]) if key in index else None
        if why is not None:
            out.setdefault(why, []).append(key)
    return out


def _launch(family: Family, keys: Mapping[str, str] | list[str]) -> str:
    keys = sorted(keys)
    if len(keys) == 1:
        return LAUNCH.format(job=family.build_job, key=keys[0])
    every = LAUNCH.format(job=family.build_job, key="KEY")
    return f"{every} for each, or let {family.nightly} build them"


def partition_states(instance: Any, family: Family, keys: list[str]) -> dict[str, str]:
    """Key → ``running``, or the root cause of the failed run that left one of the family's
    raw or stored assets failed, from the instance."""
    import dagster as dg

    from zarrfeed.assets.partitions import partitions_def

    out: dict[str, str] = {}
    for name in (family.raw.asset, *(a.name for a in family.assets)):
        states = instance.get_status_by_partition(dg.AssetKey(name), keys, partitions_def(family))
        for key, state in (states or {}).items():
            if state == dg.AssetPartitionStatus.IN_PROGRESS:
                out[key] = "running"
            elif state == dg.AssetPartitionStatus.FAILED and key not in out:
                out[key] = failure_cause(instance, key)
    return out


def failure_cause(instance: Any, key: str) -> str:
    """The root cause of the latest failed run of partition ``key``, one line."""
    import dagster as dg

    runs = instance.get_runs(
        filters=dg.RunsFilter(
            tags={"dagster/partition": key}, statuses=[dg.DagsterRunStatus.FAILURE]
        ),
        limit=1,
    )
    if not runs:
        return "its last run failed"
    for record in instance.all_logs(runs[0].run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        event = record.dagster_event
        return f"{event.step_key}: {root_cause(event.event_specific_data.error)}"
    for record in instance.all_logs(runs[0].run_id, of_type=dg.DagsterEventType.RUN_FAILURE):
        if record.dagster_event.message:  # a run failed from outside, e.g. its process gone
            return f"run {runs[0].run_id[:8]}: {record.dagster_event.message}"
    return f"run {runs[0].run_id[:8]} failed"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="per family: missing, stale, failed, running; the fix")
    reader_options(p, main)


def main(args: argparse.Namespace) -> int:
    from zarrfeed.commands.instance import home_of, open_instance
    from zarrfeed.resources import ZarrStoreResource

    store = existing_store(args.store)
    resource = ZarrStoreResource(url=args.store)
    home = home_of(args.dagster_home)
    instance = open_instance(home) if home else None
    summary, entries = [], []
    try:
        for component in families():
            family = component.declaration
            keys = instance.get_dynamic_partitions(family.partitions) if instance else None
            states = partition_states(instance, family, keys) if instance else {}
            total, found = family_status(
                family, store, resource.catalog(family.name), component.values(), keys, states
            )
            counts = {"family": family.name, "partitions": total}
            versions = dataset_versions(store, family.name)
            counts["dataset_versions"] = len(versions)
            counts["retained_bytes"] = sum(v["retained_bytes"] for v in versions)
            for e in found:
                counts[e.state] = counts.get(e.state, 0) + len(e.keys)
            summary.append(counts)
            entries += found
    finally:
        if instance is not None:
            instance.dispose()
    if args.json:
        print_json({"instance": str(home) if home else None, "families": summary,
                    "problems": [e.to_json() for e in entries]})  # fmt: skip
        return 1 if entries else 0
    where = f"instance {home}" if home else "no Dagster instance (partitions from the catalog)"
    print_table(
        ["family", "partitions", *STATES, "versions", "retained"],
        [
            [
                s["family"],
                s["partitions"],
                *(s.get(k, 0) for k in STATES),
                s["dataset_versions"],
                human_bytes(s["retained_bytes"]),
            ]
            for s in summary
        ],
        title=f"store {store.url}; {where}",
        notes=[
            "versions: dataset versions kept readable; retained: bytes only they hold "
            "(`zarrfeed datasets list`)"
        ],
    )
    if entries:
        print_table(
            ["family", "state", "partitions", "why", "fix"],
            [
                [
                    e.family,
                    e.state,
                    ", ".join(e.keys[:5]) + (" …" if len(e.keys) > 5 else ""),
                    e.why,
                    e.fix,
                ]
                for e in entries
            ],
        )
    else:
        print("every partition is current")
    return 1 if entries else 0
