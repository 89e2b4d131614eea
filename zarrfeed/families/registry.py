"""The families training and discovery know: the built-in ones and those ``ZARRFEED_FAMILIES``
names.

A family of your own (``ZARRFEED_FAMILIES=my_lab.families:OCT``, several separated by
commas) gets its training tasks listed, validated and trained like the built-in ones, and
its discovery sees the raw folder less what every registered family claims.  Nothing is
kept between calls: the environment is read, and the declarations imported (Python keeps
imported modules), each time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zarrfeed.families.family import Family, import_reference
from zarrfeed.formats.walk import Tree, TreeCache, walk_tree
from zarrfeed.sources.raw import Scan

BUILT_IN = (
    "zarrfeed.families.ct:CT",
    "zarrfeed.families.spike:SPIKE",
    "zarrfeed.families.images:IMAGES",
)
ENV = "ZARRFEED_FAMILIES"


def load_family(reference: str) -> Family:
    """The declaration at ``module:NAME`` (``zarrfeed.families.ct:CT``)."""
    try:
        declared = import_reference(reference)
    except ValueError:
        declared = None
    if not isinstance(declared, Family):
        raise ValueError(f"family: {reference!r} is not a family declaration (module:NAME)")
    return declared


def families() -> list[Family]:
    """The built-in families, then those ``ZARRFEED_FAMILIES`` names, each once."""
    extra = [r.strip() for r in os.environ.get(ENV, "").split(",") if r.strip()]
    found: dict[str, Family] = {}
    for reference in (*BUILT_IN, *extra):
        family = load_family(reference)
        found.setdefault(family.name, family)
    return list(found.values())


def task_types() -> dict[str, Any]:
    """Task name → task class of every registered family, in the families' order; a name
    two tasks share is an error naming both."""
    found: dict[str, Any] = {}
    where: dict[str, str] = {}
    for family in families():
        for reference in family.tasks:
            task = import_reference(reference)
            if task.name in found and where[task.name] != reference:
                raise ValueError(
                    f"task {task.name!r}: declared by {where[task.name]} and {reference}"
                )
            found[task.name], where[task.name] = task, reference
    return found


def family_tree(
    family: Family,
    root: str | Path,
    cache: TreeCache | None = None,
    others: Sequence[Family] | None = None,
) -> Tree:
    """The walk of ``root`` that ``family``'s discovery sees (reusing ``cache``, the caller's
    from its earlier walks): every folder less those the ``others`` (default: every
    registered family) claim, so that two families never both take the same files."""
    tree = walk_tree(root, cache)
    others = families() if others is None else others
    return tree.without([p for f in others if f.name != family.name for p in f.raw.claims(tree)])


def scan_raw(family: Family, root: str | Path, cache: TreeCache | None = None) -> Scan:
    """Key → catalog entry of every raw item of ``family`` under ``root``, found in
    :func:`family_tree` (no file is read)."""
    return family.raw.scan(os.fspath(root), family_tree(family, root, cache))
