"""The Dagster instance a command reads: ``--dagster-home``, else ``DAGSTER_HOME``, else the
demo's ``.dagster_home`` when it exists; and the hold a command that fills an instance (the
demo, the hub build) keeps on it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DEFAULT_HOME = ".dagster_home"
LOCK = "zarrfeed.lock"  # in a Dagster home: held by the demo or hub build filling it


def home_of(given: str | None) -> Path | None:
    """The instance folder to use, or None when there is none."""
    for candidate in (given, os.environ.get("DAGSTER_HOME"), DEFAULT_HOME):
        if candidate and (Path(candidate) / "dagster.yaml").is_file():
            return Path(candidate).resolve()
        if candidate and candidate == given:
            from zarrfeed.errors import ConfigError

            raise ConfigError(
                f"--dagster-home {given}: no Dagster instance there (no dagster.yaml); run "
                "`zarrfeed demo` or point at the DAGSTER_HOME your runs use"
            )
    return None


def open_instance(home: Path) -> Any:
    """The instance in ``home`` (a ``dagster.DagsterInstance``; close it after use)."""
    import dagster as dg

    os.environ["DAGSTER_HOME"] = str(home)
    return dg.DagsterInstance.get()


def hold_home(home: Path, command: str) -> Any:
    """Hold ``home`` for ``command``'s life (a :class:`~zarrfeed.processes.Hold`), or refuse
    in one line naming the home and the holder.  Two commands creating one instance's
    SQLite storage at once break it: the second dies on Dagster's "dynamic partitions table
    ... dagster instance migrate", which sends one to the wrong fix."""
    from zarrfeed.errors import ConfigError
    from zarrfeed.processes import Held, hold

    try:
        return hold(Path(home).resolve() / LOCK, f"zarrfeed {command}")
    except Held as held:
        raise ConfigError(
            f"the Dagster home {Path(home).resolve()} is in use by {held.who()}"
            f": wait for it to end, or give this one another --dagster-home"
        ) from None
