"""The data families, one package each (``zarrfeed.families.ct``, ``.spike``, ``.images``):
its declaration, its discovery and its training tasks; and what they share here — the
:class:`Family` declaration, facts, stages and the registry of families.  Everything else —
Dagster assets, checks, jobs, sensors, schedules, manifests, the CLI, training's readers and
tasks — derives from a :class:`Family`; a new family is a declaration, its reader and its
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
