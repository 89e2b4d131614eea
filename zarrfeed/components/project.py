"""The families of the code location, read from its ``defs`` folder without building it:
what the commands (``status``, ``verify``, ``inspect``, ``partitions``, ``demo``) work on, with
the settings the definitions use."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from zarrfeed.components.family import FamilyComponent

PROJECT = Path(__file__).resolve().parents[1]  # inside the project whose pyproject has [tool.dg]


def project_families(path: Path = PROJECT) -> list[FamilyComponent]:
    """The family components of the project at ``path``, in the defs folder's order."""
    return dg.ComponentTree.for_project(path).get_all_components(of_type=FamilyComponent)
