"""Dagster assets: orchestration only; the work is in the families' builders, transforms,
formats and the store.

Every asset derives from a declaration: a family's raw, stored, dataset and hub assets from
its :class:`~zarrfeed.families.Family` (:func:`family_assets`), the models from the training
tasks (:func:`model_asset`).
"""

from zarrfeed.assets.family import family_assets

__all__ = ["family_assets"]
