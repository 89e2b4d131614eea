"""A data family as a Dagster component: its declaration and its settings, from YAML.

The settings the component is given are the only settings its definitions use: code
versions (what the UI marks stale), the fingerprints partitions are built and reused with,
and the nightly schedule's notion of out of date all come from them.  Changing a setting in
``defs.yaml`` and reloading the code location therefore marks exactly the assets that
declare it stale, and the next nightly run rebuilds their partitions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import dagster as dg

from zarrfeed.assets.datasets import dataset_asset
from zarrfeed.assets.family import family_assets
from zarrfeed.assets.hub import hub_asset
from zarrfeed.families import Family
from zarrfeed.families.registry import load_family
from zarrfeed.jobs.build import build_job, dataset_job, hub_job
from zarrfeed.jobs.discovery import discovery_sensor
from zarrfeed.jobs.nightly import nightly_schedule
from zarrfeed.resources import HuggingFaceResource


def family_defs(family: Family, settings: Mapping[str, Any] | None = None) -> dg.Definitions:
    """Everything Dagster knows of ``family`` with ``settings`` (validated by the family's
    settings model; unset values take their defaults)."""
    values = family.values(settings)
    job, manifest = build_job(family), dataset_job(family)
    jobs = [job, manifest, *([hub_job(family)] if family.hub else [])]
    hub = [hub_asset(family)] if family.hub else []
    return dg.Definitions(
        assets=[*family_assets(family, values), dataset_asset(family, values), *hub],
        jobs=jobs,
        sensors=[discovery_sensor(family, job, manifest)],
        schedules=[nightly_schedule(family, job, values)],
        resources={"hf": HuggingFaceResource()} if family.hub else {},
    )


class FamilyComponent(dg.Component, dg.Model, dg.Resolvable):
    """One data family: ``family`` names its declaration, ``settings`` its values."""

    family: str
    settings: dict[str, Any] = {}  # noqa: RUF012 (pydantic copies field defaults)

    @property
    def declaration(self) -> Family:
        return load_family(self.family)

    def values(self) -> dict[str, Any]:
        """The settings the family's definitions use (defaults filled in)."""
        return self.declaration.values(self.settings)

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return family_defs(self.declaration, self.settings)
