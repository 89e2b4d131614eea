"""NIfTI volumes through nibabel, reoriented to a canonical (z, y, x) array."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
from isal import igzip

from zarrfeed.errors import InputError
from zarrfeed.formats.volume import Volume


def _load(path: Path, whole: bool = False) -> nib.Nifti1Image:
    """The image; with ``whole`` a ``.nii.gz`` is inflated up front by ISA-L's igzip, about
    2-3x faster than the zlib stream nibabel reads it through (CT ingest decodes every scan)."""
    try:
        if whole and path.name.endswith(".gz"):
            raw = igzip.decompress(path.read_bytes())
            nifti2 = 540 in (int.from_bytes(raw[:4], "little"), int.from_bytes(raw[:4], "big"))
            img = (nib.Nifti2Image if nifti2 else nib.Nifti1Image).from_bytes(raw)
        else:
            img = nib.load(path)
    except Exception as exc:  # nibabel raises several unrelated types for bad files
        raise InputError(path, "a NIfTI-1/2 image", f"an unreadable file ({exc})") from exc
    if not isinstance(img, nib.Nifti1Image | nib.Nifti2Image):
        raise InputError(path, "a NIfTI image", type(img).__name__)
    if len(img.shape) != 3:
        raise InputError(path, "a 3-D volume", f"shape {img.shape}")
    return img


@dataclass(frozen=True)
class NiftiHeader:
    """What the header says, in the canonical (z, y, x) order of :func:`read_nifti`."""

    shape: tuple[int, int, int]
    spacing: tuple[float, float, float]
    meta: dict[str, str]


def read_nifti_header(path: str | Path) -> NiftiHeader:
    """Shape, spacing, dtype and orientation without decoding the voxels (cheap for .nii.gz)."""
    path = Path(path)
    img = _load(path)
    ornt = nib.orientations.io_orientation(img.affine)
    order = ornt[:, 0].argsort()
    shape = tuple(int(img.shape[int(a)]) for a in order)[::-1]
    zooms = tuple(float(img.header.get_zooms()[int(a)]) for a in order)[::-1]
    return NiftiHeader(
        shape=shape,
        spacing=zooms,
        meta={
            "dtype": str(img.get_data_dtype()),
            "orientation_on_disk": "".join(nib.aff2axcodes(img.affine)),
        },
    )


def read_nifti(path: str | Path, canonical: bool = True) -> Volume:
    """Read stored values, header rescale, spacing and orientation of a 3-D NIfTI file.

    With ``canonical`` the voxel axes are first brought to RAS+ (``as_closest_canonical``)
    and then transposed to (z, y, x) = (S, A, R), so every scan has the same orientation.
    """
    path = Path(path)
    img = _load(path, whole=True)
    axcodes = "".join(nib.aff2axcodes(img.affine))
    slope, intercept = img.dataobj.slope, img.dataobj.inter
    data = np.asarray(img.dataobj.get_unscaled())
    affine, zooms = img.affine, img.header.get_zooms()[:3]
    if canonical:
        ornt = nib.orientations.io_orientation(img.affine)
        data = nib.orientations.apply_orientation(data, ornt)
        affine = img.affine @ nib.orientations.inv_ornt_aff(ornt, img.shape)
        zooms = tuple(zooms[int(axis)] for axis in ornt[:, 0].argsort())
    return Volume(
        data=data.transpose(2, 1, 0),
        spacing=(float(zooms[2]), float(zooms[1]), float(zooms[0])),
        source=str(path),
        slope=float(slope) if np.isfinite(slope) else 1.0,
        intercept=float(intercept) if np.isfinite(intercept) else 0.0,
        affine=affine,
        meta={"orientation_on_disk": axcodes, "orientation": "".join(nib.aff2axcodes(affine))},
    )


def write_nifti(
    path: str | Path,
    data_zyx: np.ndarray,
    spacing_zyx: tuple[float, float, float],
    slope: float | None = None,
    intercept: float | None = None,
) -> None:
    """Write a (z, y, x) array as a RAS NIfTI with the given spacing (used for sample data)."""
    sz, sy, sx = spacing_zyx
    img = nib.Nifti1Image(
        np.ascontiguousarray(data_zyx.transpose(2, 1, 0)), np.diag([sx, sy, sz, 1.0])
    )
    img.header.set_xyzt_units("mm")
    if slope is not None:
        img.header.set_slope_inter(slope, intercept)
    nib.save(img, Path(path))
