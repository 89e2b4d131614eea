"""What several commands share: the options of those that read the store and the instance,
an integer type with a floor, and the refusal of a store that does not exist."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from zarrfeed import defaults
from zarrfeed.errors import StoreError


def default_store() -> str:
    return os.environ.get("ZARRFEED_STORE", defaults.STORE)


def reader_options(
    p: argparse.ArgumentParser, func: Callable, instance: bool = True, json: bool = True
) -> None:
    """The options of the commands that read the store (and the instance)."""
    p.add_argument("--store", default=default_store(), help="Zarr store folder or URL")
    if instance:
        p.add_argument("--dagster-home", help="instance (default: DAGSTER_HOME, .dagster_home)")
    if json:
        p.add_argument("--json", action="store_true", help="JSON for scripts")
    p.set_defaults(func=func)


def count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least`` (argparse names the flag)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {least}, found {value}")
        return value

    parse.__name__ = "count"
    return parse


def existing_store(url: str) -> Any:
    """The store at ``url``, refused when it does not exist: read as empty, a mistyped
    --store would report every partition as gone (and advise removing them)."""
    from zarrfeed.store import ZarrStore

    store = ZarrStore(url)
    if not store.exists():
        raise StoreError(
            f"no zarrfeed store at {store.url}: check --store (or ZARRFEED_STORE); a build or "
            "`zarrfeed demo` creates one"
        )
    return store


def families() -> list[Any]:
    """The family components of the code location (declaration and settings)."""
    from zarrfeed.components import project_families

    return project_families()


def family_named(name: str) -> Any:
    """The component of family ``name``, or an error naming the families there are."""
    from zarrfeed.errors import ConfigError

    found = {c.declaration.name: c for c in families()}
    if name not in found:
        raise ConfigError(f"no family {name!r}; the families are {', '.join(found)}")
    return found[name]
