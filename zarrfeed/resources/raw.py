"""The raw-data folder discovery scans."""

from __future__ import annotations

import os
from collections.abc import Callable

import dagster as dg

from zarrfeed.sources.raw import Scan, raw_origin, scan_ct, scan_images, scan_spike

SCANNERS: dict[str, Callable[[str], Scan]] = {
    "ct": scan_ct,
    "spike": scan_spike,
    "images": scan_images,
}


class RawFolderResource(dg.ConfigurableResource):
    """The raw-data folder: CT volumes (NIfTI, DICOM series, ``.npy``/``.npz`` with their
    spacing), spike sequences, image sets, and CT-RATE's CSVs."""

    root: str = "data/raw"

    @property
    def origin(self) -> str:
        return raw_origin(self.root)

    def scan(self, family: str) -> Scan:
        """Key → catalog entry of every raw item of ``family`` (no file is read), and the
        broken entries skipped (``.skipped``).  Locations
        are absolute: a relative root (the .env default) and the same folder given absolute
        (``zarrfeed demo``) must not make every item look changed."""
        return SCANNERS[family](os.path.abspath(self.root))
