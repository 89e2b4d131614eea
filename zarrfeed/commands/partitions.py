"""``zarrfeed partitions remove FAMILY KEY``: drop a partition that has no raw source — a typo
typed into the UI's "Add a partition", or an item whose file was deleted — from the Dagster
instance, the store and the raw-item catalog, so that nothing keeps reporting it."""

from __future__ import annotations

import contextlib
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zarrfeed.errors import ConfigError, StoreError
from zarrfeed.store.contract import FAMILIES


@dataclass
class Removal:
    """What removing partition ``key`` of ``family`` touches."""

    family: str
    key: str
    in_instance: bool = False
    stored: list[str] = field(default_factory=list)  # store paths with a committed partition
    catalogued: bool = False
    in_dataset: bool = False

    def lines(self) -> list[str]:
        out = []
        if self.in_instance:
            out.append(f"the Dagster partition {self.key!r} of {FAMILIES[self.family].partitions}")
        out += [f"the committed partition {p}/{self.key}" for p in self.stored]
        if self.catalogued:
            out.append(f"the {self.family} catalog entry {self.key!r}")
        return out


def plan(family: str, key: str, store: Any, catalog: Any, instance: Any | None) -> Removal:
    """What there is to remove; refuses a key whose raw source still exists (discovery would
    add it straight back)."""
    if family not in FAMILIES:
        raise ConfigError(f"no family {family!r}; the families are {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
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
    removal = Removal(family, key, catalogued=item is not None)
    removal.stored = [a.path for a in spec.assets if store.has_partition(a.path, key)]
    if instance is not None:
        removal.in_instance = instance.has_dynamic_partition(spec.partitions, key)
    with contextlib.suppress(StoreError):  # no manifest yet
        removal.in_dataset = key in store.read_manifest(spec.dataset.name)["keys"]
    if not removal.lines():
        known = instance.get_dynamic_partitions(spec.partitions) if instance else []
        close = difflib.get_close_matches(key, [*known, *catalog.index()], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"no {family} partition {key!r} in the instance, store or catalog{hint}")
    return removal


def execute(removal: Removal, store: Any, catalog: Any, instance: Any | None) -> None:
    spec = FAMILIES[removal.family]
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
