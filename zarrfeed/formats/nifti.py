"""NIfTI-1/2 volumes, reoriented to a canonical (z, y, x) array.

nibabel parses the header; the voxels are read here, after the header's claim has been
checked against the file: an uncompressed file must hold ``vox_offset + voxel bytes``, a
``.nii.gz`` must be able to inflate to that (deflate expands at most 1032:1) and is then
inflated into a buffer of exactly that size, so a hostile header never allocates more than
the file could hold.  The gzip ISIZE footer is not used as a bound: it is the size modulo
2³² of the last member only, wrong for multi-member (bgzip) files and for volumes over 4 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
from isal import igzip
from nibabel.openers import ImageOpener

from zarrfeed.errors import InputError
from zarrfeed.formats.limits import (
    claimed_bytes,
    fill,
    require_allocatable,
    require_bytes,
    require_inflatable,
)
from zarrfeed.formats.volume import Volume, to_ras
from zarrfeed.transforms.hu import IDENTITY, Rescale


@dataclass(frozen=True)
class _Layout:
    """The header's facts, checked: voxel shape (x, y, z), dtype, data offset, affine."""

    header: nib.Nifti1Header
    shape: tuple[int, int, int]
    dtype: np.dtype
    offset: int
    affine: np.ndarray
    zooms: tuple[float, float, float]

    @property
    def nbytes(self) -> int:
        return claimed_bytes(self.shape, self.dtype.itemsize)

    def describe(self) -> str:
        return f"a {'×'.join(map(str, self.shape))} {self.dtype} volume at offset {self.offset}"

    def ornt(self) -> np.ndarray:
        return nib.orientations.io_orientation(self.affine)


def _read_header(path: Path) -> nib.Nifti1Header:
    try:
        with ImageOpener(path) as f:
            first = f.read(4)
            f.seek(0)
            nifti2 = 540 in (int.from_bytes(first, "little"), int.from_bytes(first, "big"))
            # check=False: nibabel's checks repair headers (a 0 mm voxel becomes 1 mm); the
            # checks here refuse them instead.
            klass = nib.Nifti2Header if nifti2 else nib.Nifti1Header
            header = klass.from_fileobj(f, check=False)
            header.get_data_dtype()  # an unknown datatype code raises here
    except Exception as exc:  # nibabel and gzip raise several unrelated types for bad files
        raise InputError(path, "a NIfTI-1/2 header", f"an unreadable file ({exc})") from exc
    magic = bytes(header["magic"])[:3]
    if magic not in (b"n+1", b"n+2"):
        raise InputError(path, "a single-file NIfTI (magic n+1 or n+2)", f"magic {magic!r}")
    return header


def _layout(path: Path) -> _Layout:
    """The header, checked for sense and against the file size before any voxel is read."""
    header = _read_header(path)
    shape = tuple(int(n) for n in header.get_data_shape())
    while len(shape) > 3 and shape[-1] == 1:
        shape = shape[:-1]  # one time point (or component) written as 4-D or 5-D
    if len(shape) != 3 or min(shape) < 1:
        raise InputError(path, "a 3-D volume", f"shape {shape}")
    dtype = header.get_data_dtype()
    if dtype.kind not in "iuf" or dtype.fields:
        raise InputError(path, "integer or float voxels", f"data type {dtype}")
    zooms, affine = _geometry(path, header)
    offset = max(header.get_data_offset(), header.single_vox_offset)
    layout = _Layout(header, shape, dtype, offset, affine, zooms)
    if np.isnan(layout.ornt()).any():
        raise InputError(path, "an affine with one image axis per world axis", str(affine))
    size = path.stat().st_size
    if path.name.lower().endswith(".gz"):
        require_inflatable(path, offset + layout.nbytes, size, layout.describe())
    else:
        require_bytes(path, offset + layout.nbytes, size, layout.describe())
    return layout


def _require_memory(path: Path, layout: _Layout) -> None:
    """The volume and the float32 HU copy a build makes of it must be plausible and fit."""
    hu_copy = claimed_bytes(layout.shape, 4)
    what = f"{layout.describe()} and its float32 HU copy"
    require_allocatable(path, layout.offset + layout.nbytes + hu_copy, what)


# What a millimetre is in each of the header's xyz units; "unknown" is taken as mm.
_MM = {"meter": 1000.0, "mm": 1.0, "micron": 1e-3, "unknown": 1.0}


def _geometry(path: Path, header: nib.Nifti1Header) -> tuple[tuple[float, ...], np.ndarray]:
    """Voxel sizes (i, j, k) and the affine, both in millimetres.

    With neither sform nor qform, the NIfTI standard's method 1 applies (x = pixdim[1]·i,
    no flip), not nibabel's Analyze-style left-right flip.  The affine's voxel sizes must
    agree with pixdim: spacing and orientation never come from two different claims.
    """
    try:
        zooms = tuple(abs(float(z)) for z in header.get_zooms()[:3])  # the sign is the affine's
        if header["sform_code"] == 0 and header["qform_code"] == 0:
            affine = np.diag([*zooms, 1.0])
        else:
            affine = np.asarray(header.get_best_affine(), dtype=float)
            if header["qform_code"] > 0 and not np.linalg.det(affine[:3, :3]):
                affine = np.asarray(header.get_qform(), dtype=float)  # a zeroed sform
        unit = header.get_xyzt_units()[0]
    except Exception as exc:  # nibabel refuses impossible quaternions, codes, …
        found = f"{type(exc).__name__}: {exc}"
        raise InputError(path, "a readable voxel geometry", found) from None
    if not (all(np.isfinite(z) and z > 0 for z in zooms) and np.isfinite(affine).all()):
        raise InputError(path, "positive voxel sizes and a finite affine", f"pixdim {zooms}")
    sizes = np.linalg.norm(affine[:3, :3], axis=0)
    if not np.allclose(sizes, zooms, rtol=0.01):
        raise InputError(
            path,
            "voxel sizes in pixdim that agree with the sform/qform",
            f"pixdim {zooms}, affine columns {tuple(round(float(v), 6) for v in sizes)}",
        )
    scale = _MM.get(unit, 1.0)
    affine[:3] *= scale
    return tuple(z * scale for z in zooms), affine


def _inflate(path: Path, size: int) -> np.ndarray:
    """The first ``size`` bytes of a gzip file, in a buffer of exactly that size."""
    buf = np.empty(size, dtype=np.uint8)
    try:
        with igzip.open(path, "rb") as f:
            got = fill(f, buf)
    except (OSError, EOFError) as exc:
        raise InputError(path, "a complete gzip stream", str(exc)) from exc
    if got < size:
        raise InputError(path, f"{size} bytes after inflating", f"the stream ends after {got}")
    return buf


def _voxels(path: Path, layout: _Layout) -> np.ndarray:
    _require_memory(path, layout)
    count = layout.nbytes // layout.dtype.itemsize
    if path.name.lower().endswith(".gz"):
        buf = _inflate(path, layout.offset + layout.nbytes)
        data = np.ndarray(layout.shape, layout.dtype, buf, layout.offset, order="F")
    else:
        flat = np.fromfile(path, dtype=layout.dtype, count=count, offset=layout.offset)
        data = flat.reshape(layout.shape, order="F")
    return data if data.dtype.isnative else data.astype(data.dtype.newbyteorder("="))


@dataclass(frozen=True)
class NiftiHeader:
    """What the header says, in the canonical (z, y, x) order of :func:`read_nifti`."""

    shape: tuple[int, int, int]
    spacing: tuple[float, float, float]
    meta: dict[str, str]


def read_nifti_header(path: str | Path) -> NiftiHeader:
    """Shape, spacing, dtype and orientation without decoding the voxels (cheap for .nii.gz);
    the header is checked against the file size like :func:`read_nifti` does."""
    path = Path(path)
    layout = _layout(path)
    order = layout.ornt()[:, 0].argsort()
    return NiftiHeader(
        shape=tuple(layout.shape[int(a)] for a in order)[::-1],
        spacing=tuple(layout.zooms[int(a)] for a in order)[::-1],
        meta={
            "dtype": str(layout.dtype),
            "orientation_on_disk": "".join(nib.aff2axcodes(layout.affine)),
        },
    )


def read_nifti(path: str | Path, canonical: bool = True) -> Volume:
    """Stored values, spacing and orientation of a 3-D NIfTI file, with the header's rescale
    as the ``nifti_header`` claim (see :func:`_scaling_claim`).

    With ``canonical`` the voxel axes are first brought to RAS+ and then transposed to
    (z, y, x) = (S, A, R), so every scan has the same orientation.
    """
    path = Path(path)
    layout = _layout(path)
    data, affine, zooms = _voxels(path, layout), layout.affine, layout.zooms
    if canonical:
        data, affine, spacing = to_ras(data, affine, zooms)
    else:
        data, spacing = data.transpose(2, 1, 0), (zooms[2], zooms[1], zooms[0])
    return Volume(
        data=data,
        spacing=spacing,
        source=str(path),
        claims=_scaling_claim(layout.header),
        affine=affine,
        meta={
            "orientation_on_disk": "".join(nib.aff2axcodes(layout.affine)),
            "orientation": "".join(nib.aff2axcodes(affine)),
        },
    )


def _scaling_claim(header: nib.Nifti1Header) -> dict[str, Rescale]:
    """``scl_slope``/``scl_inter`` as a claim, when they change values.  Slope 0 or NaN means
    unset; (1, 0) is what nibabel, ITK and dcm2niix write for unscaled data, so it cannot be
    read as "these values are HU" and is no claim either."""
    slope, inter = float(header["scl_slope"]), float(header["scl_inter"])
    if not np.isfinite(slope) or slope == 0:
        return {}
    rescale = Rescale(slope, inter if np.isfinite(inter) else 0.0)
    return {} if rescale == IDENTITY else {"nifti_header": rescale}


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
