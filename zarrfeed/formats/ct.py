"""A raw CT item of any kind (NIfTI file, DICOM series, ``.npy``/``.npz`` volume) and its reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import Literal

import numpy as np

from zarrfeed.formats.arrays import read_array_volume
from zarrfeed.formats.volume import Volume
from zarrfeed.transforms import ct, hu

CTKind = Literal["nifti", "dicom", "npy", "npz"]
CT_SUFFIXES = (".nii.gz", ".nii")
ARRAY_SUFFIXES = (".npy", ".npz")


def ct_stem(path: PurePath | str) -> str:
    """The file name without its CT suffix (``.nii.gz`` is one suffix, in any case)."""
    name = path.name if isinstance(path, PurePath) else path.rsplit("/", 1)[-1]
    for suffix in CT_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return PurePosixPath(name).stem


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
    # The NIfTI and DICOM readers (nibabel, pydicom: ~0.6 s) are imported when one is read,
    # not by the families and discovery that name CT kinds and suffixes.
    if item.kind == "nifti":
        from zarrfeed.formats.nifti import read_nifti

        return read_nifti(item.path)
    if item.kind == "dicom":
        from zarrfeed.formats.dicom import read_dicom_series

        return read_dicom_series(item.files, series_uid=item.series_uid)
    return read_array_volume(item.path)


def ct_clip_input(
    path: str | Path,
    csv: hu.Rescale | None = None,
    override: hu.Rescale | hu.Override | None = None,
) -> np.ndarray:
    """CT-CLIP's input tensor of a NIfTI file, without its channel axis: (240, 480, 480)
    float32 in [-1, 1], axes (k, i, j) of the file's stored voxel grid, as CT-CLIP's
    ``nii_img_to_tensor`` returns it (see :data:`zarrfeed.transforms.ct.CT_CLIP`).

    HU is decided from the evidence like every build does (``csv`` the CT-RATE metadata
    row's rescale, ``override`` the user's); CT-CLIP itself applies the CSV's rescale to
    ``get_fdata()`` unconditionally.  The spacing is the header's, CT-CLIP's the CSV's.
    """
    from zarrfeed.formats.nifti import read_nifti

    vol = read_nifti(path, canonical=False)  # (z, y, x) = (k, j, i): no reorientation
    data, _ = vol.to_hu(csv=csv, override=override)
    return ct.preprocess(data, vol.spacing, ct.CT_CLIP)
