"""Dagster assets: orchestration only; the work is in transforms, formats and store.

Stored assets take their keys, dependencies, checks, descriptions and code versions from the
data contract (``zarrfeed.store.contract``); code versions include a hash of the settings an
asset declares, so :func:`make_assets` builds them from the settings the code location runs
with.
"""

from collections.abc import Mapping

import dagster as dg

from zarrfeed.assets.ct import ct_assets
from zarrfeed.assets.datasets import dataset_assets
from zarrfeed.assets.hub import hub_ct_catalog
from zarrfeed.assets.images import image_assets
from zarrfeed.assets.spike import spike_assets
from zarrfeed.assets.training import model_assets
from zarrfeed.resources import Settings

FAMILY_ASSETS = {"ct": ct_assets, "spike": spike_assets, "images": image_assets}
SETTINGS = {"ct": "ct_settings", "spike": "spike_settings", "images": "image_settings"}


def family_assets(family: str, resources: Mapping[str, object]) -> list[dg.AssetsDefinition]:
    """One family's assets, with code versions from the settings in ``resources``."""
    settings = resources.get(SETTINGS[family])
    values = settings.values() if isinstance(settings, Settings) else {}
    return FAMILY_ASSETS[family](values)


def make_assets(resources: Mapping[str, object]) -> list[dg.AssetsDefinition]:
    """Every asset of the code location."""
    families = [a for family in FAMILY_ASSETS for a in family_assets(family, resources)]
    return [*families, *dataset_assets, hub_ct_catalog, *model_assets]


__all__ = ["dataset_assets", "family_assets", "make_assets", "model_assets"]
