"""The Dagster code location (``dg dev -w workspace.yaml``): the ``zarrfeed/defs`` folder."""

from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
