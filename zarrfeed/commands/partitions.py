"""``zarrfeed partitions remove FAMILY KEY``: drop a partition that has no raw source — a typo
typed into the UI's "Add a partition", or an item whose file was deleted — from the Dagster
instance, the store and the raw-item catalog, so that nothing keeps reporting it."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zarrfeed.commands.options import existing_store, family_named, reader_options
from zarrfeed.datasets import read_manifest
from zarrfeed.errors import ConfigError, StoreError
from zarrfeed.families import Family


@dataclass
class Removal:
    """What removing partition ``key`` of ``family`` touches."""

    family: Family
    key: str
    in_instance: bool = False
    stored: list[str] = field(default_factory=list)  # store paths with a committed partition
    catalogued: bool = False
    in_dataset: bool = False

    def lines(self) -> list[str]:
        out = []
        if self.in_instance:
            out.append(f"the Dagster partition {self.key!r} of {self.family.partitions}")
        out += [f"the committed partition {p}/{self.key}" for p in self.stored]
        if self.catalogued:
            out.append(f"the {self.family.name} catalog entry {self.key!r}")
        return out


def plan(spec: Family, key: str, store: Any, catalog: Any, instance: Any | None) -> Removal:
    """What there is to remove; refuses a key whose raw source still exists (discovery would
    add it straight back)."""
    family = spec.name
    item = catalog.get(key)
    if item is not None and Path(item.location).exists():
        fix = (
            f"rename one of {item.location}, {', '.join(item.conflict)}"
            if item.conflict
            else "move or delete that file first, then remove the partition"
        )
        raise ConfigError(
            f"{family} partition {key!r} has a raw source, {item.location}: discovery would "
            f"add it back; {fix}"
        )
    removal = Removal(spec, key, catalogued=item is not None)
    removal.stored = [a.path for a in spec.assets if store.has_partition(a.path, key)]
    if instance is not None:
        removal.in_instance = instance.has_dynamic_partition(spec.partitions, key)
    with contextlib.suppress(StoreError):  # no manifest yet
        removal.in_dataset = key in read_manifest(store, spec.name)["keys"]
    if not removal.lines():
        known = instance.get_dynamic_partitions(spec.partitions) if instance else []
        close = difflib.get_close_matches(key, [*known, *catalog.index()], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"no {family} partition {key!r} in the instance, store or catalog{hint}")
    return removal


def execute(removal: Removal, store: Any, catalog: Any, instance: Any | None) -> None:
    spec = removal.family
    for path in removal.stored:
        store.delete_partition(path, removal.key)
    if removal.catalogued:
        # The catalog's own diff drops an item its origin no longer lists.
        item = catalog.get(removal.key)
        kept = {k: v for k, v in catalog.index().items() if v.origin == item.origin}
        kept.pop(removal.key, None)
        catalog.update(item.origin, kept)
    if removal.in_instance and instance is not None:
        instance.delete_dynamic_partition(spec.partitions, removal.key)


def confirm(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise ConfigError("not a terminal, so nothing was asked or removed: pass --yes to confirm")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("partitions", help="remove a partition that has no raw source")
    p.add_argument("action", choices=["remove"])
    p.add_argument("family", help="ct, spike or images")
    p.add_argument("key", help="the partition key")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    reader_options(p, main, json=False)


def main(args: argparse.Namespace) -> int:
    from zarrfeed.commands.instance import home_of, open_instance
    from zarrfeed.resources import ZarrStoreResource

    existing_store(args.store)
    family = family_named(args.family).declaration
    resource = ZarrStoreResource(url=args.store)
    store, catalog = resource.store(), resource.catalog(family.name)
    home = home_of(args.dagster_home)
    instance = open_instance(home) if home else None
    try:
        removal = plan(family, args.key, store, catalog, instance)
        print("This removes " + "; ".join(removal.lines()) + ".")
        if not confirm("Remove?", args.yes):
            print("nothing removed")
            return 1
        execute(removal, store, catalog, instance)
    finally:
        if instance is not None:
            instance.dispose()
    print(f"removed {family.name} partition {args.key}")
    if removal.in_dataset:
        print(
            f"the {family.name} dataset manifest still lists it: refresh it with "
            f"`dg launch -m zarrfeed.definitions --job {family.dataset_job}`"
        )
    return 0
