"""A raw CT item of any kind (NIfTI file, DICOM series, ``.npy``/``.npz`` volume) and its reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from zarrfeed.formats.arrays import read_array_volume
from zarrfeed.formats.dicom import read_dicom_series
from zarrfeed.formats.nifti import read_nifti
from zarrfeed.formats.volume import Volume

CTKind = Literal["nifti", "dicom", "npy", "npz"]


@dataclass(frozen=True)
class CTItem:
    """One CT partition's source.  ``path`` is the file, or a DICOM series' folder;
    ``files`` the series' slices, or an array file and its sidecar."""

    key: str
    kind: CTKind
    path: Path
    files: tuple[Path, ...] = ()
    series_uid: str | None = None

    def sources(self) -> tuple[Path, ...]:
        """Every file the item reads (hash these for the data version)."""
        return self.files or (self.path,)


def read_ct(item: CTItem) -> Volume:
    """Stored values, spacing and HU evidence of any CT item."""
    if item.kind == "nifti":
        return read_nifti(item.path)
    if item.kind == "dicom":
        return read_dicom_series(item.files, series_uid=item.series_uid)
    return read_array_volume(item.path)
