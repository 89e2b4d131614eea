"""The raw-data folder discovery scans."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import dagster as dg

from zarrfeed import defaults
from zarrfeed.families.registry import scan_raw
from zarrfeed.formats.walk import TreeCache
from zarrfeed.sources.raw import Scan, raw_origin

if TYPE_CHECKING:
    from zarrfeed.families import Family


class RawFolderResource(dg.ConfigurableResource):
    """The raw-data folder: CT volumes (NIfTI, DICOM series, ``.npy``/``.npz`` with their
    spacing), spike sequences, image sets, and CT-RATE's CSVs."""

    root: str = defaults.RAW

    @property
    def origin(self) -> str:
        return raw_origin(self.root)

    def scan(self, family: Family, cache: TreeCache | None = None) -> Scan:
        """Key → catalog entry of every raw item of ``family`` (no file is read), and the
        broken entries skipped (``.skipped``); ``cache``: the caller's from its earlier
        scans (a sensor's, tick after tick).  Locations are absolute: a relative root (the
        .env default) and the same folder given absolute (``zarrfeed demo``) must not make
        every item look changed."""
        return scan_raw(family, os.path.abspath(self.root), cache)
