"""The Dagster instance a command reads: ``--dagster-home``, else ``DAGSTER_HOME``, else the
demo's ``.dagster_home`` when it exists."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DEFAULT_HOME = ".dagster_home"


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
