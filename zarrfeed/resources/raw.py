"""The raw-data folder discovery scans."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import dagster as dg

from zarrfeed import defaults
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

    def scan(self, family: Family) -> Scan:
        """Key → catalog entry of every raw item of ``family`` (no file is read), and the
        broken entries skipped (``.skipped``).  Locations are absolute: a relative root (the
        .env default) and the same folder given absolute (``zarrfeed demo``) must not make
        every item look changed."""
        return family.raw.scan(os.path.abspath(self.root))
