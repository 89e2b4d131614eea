"""The CT family: its declaration (:mod:`.family`), discovery (:mod:`.discover`), CT-RATE's
tables (:mod:`.tables`), training Datasets (:mod:`.datasets`, which imports torch), models
(:mod:`.models`) and training tasks (:mod:`.tasks`)."""

from zarrfeed.families.ct.family import (
    CT,
    CT_HU,
    CT_PATCHES,
    CT_SPARSE,
    CT_WINDOWS,
    LABELS,
    PATCH_TABLE,
    VERIFY_POINTS,
    CTSettings,
    axis_aligned_hu,
)

__all__ = [
    "CT",
    "CT_HU",
    "CT_PATCHES",
    "CT_SPARSE",
    "CT_WINDOWS",
    "LABELS",
    "PATCH_TABLE",
    "VERIFY_POINTS",
    "CTSettings",
    "axis_aligned_hu",
]
