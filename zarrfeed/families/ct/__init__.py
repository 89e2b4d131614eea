"""The CT family: its declaration (:mod:`.family`), discovery (:mod:`.discover`), CT-RATE's
tables (:mod:`.tables`), training Datasets (:mod:`.datasets`: ``from
zarrfeed.families.ct.datasets import CTPatchDataset``) and training tasks (:mod:`.tasks`).

Importing the package loads the declaration only; the Datasets (and torch) load with
:mod:`.datasets`."""

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
