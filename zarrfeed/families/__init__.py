"""The data families, one declaration each (``zarrfeed.families.ct``, ``.spike``,
``.images``): raw items, settings, stored stages, dataset and training readers.  Everything
else — Dagster assets, checks, jobs, sensors, schedules, manifests, the CLI, training's
readers — derives from a :class:`Family`; a new family is a declaration, its reader and its
transforms.  Nothing here imports Dagster."""

from zarrfeed.families.facts import Picture, Rows
from zarrfeed.families.family import (
    Extra,
    Family,
    HubSource,
    RawSource,
    Reader,
    Stage,
    Table,
)
from zarrfeed.families.stages import Checks, Fetch, Inputs, LocalFetch, Step

__all__ = [
    "Checks",
    "Extra",
    "Family",
    "Fetch",
    "HubSource",
    "Inputs",
    "LocalFetch",
    "Picture",
    "RawSource",
    "Reader",
    "Rows",
    "Stage",
    "Step",
    "Table",
]
