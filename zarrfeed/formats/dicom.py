"""DICOM CT series through pydicom: slices ordered by position, rescale applied per slice.

Headers are read first with the pixel data left on disk; each slice's claim (Rows ×
Columns × BitsAllocated) is checked against the bytes its PixelData element holds (or, for
compressed transfer syntaxes, could hold) before one voxel is allocated.  A series must be
one grid: equal size, pixel spacing and orientation on every slice, one slice per position.
Pixels then decode one file at a time into the volume, each slice with its own
RescaleSlope/RescaleIntercept, and PixelPaddingValue (with PixelPaddingRangeLimit) marks the
voxels outside the field of view (``Volume.padding``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from zarrfeed.errors import InputError
from zarrfeed.formats.limits import (
    MAX_INFLATE_RATIO,
    claimed_bytes,
    require_allocatable,
    require_bytes,
)
from zarrfeed.formats.volume import Volume, to_ras
from zarrfeed.transforms.hu import IDENTITY

# pydicom and nibabel (~0.6 s) are imported by the functions that read or write DICOM, not
# here: CT discovery names this module's suffixes wherever the families are declared.
if TYPE_CHECKING:
    from pydicom.dataset import Dataset

DEFER_BYTES = 1024  # values larger than this (the pixel data) stay on disk until decoded
# A compressed frame may decode to 1032× its file or to 64 MiB, whichever is more: enough
# for any real slice (512² int16 is 0.5 MiB), far short of a hostile 65535² header.
MIN_COMPRESSED_ALLOWANCE = 64 << 20
POSITION_TOLERANCE_MM = 1e-3


def _files(source: str | Path | Iterable[str | Path]) -> tuple[list[Path], bool]:
    """(files, explicit): a folder's files (non-DICOM ones skipped later), or a given list."""
    if isinstance(source, str | Path):
        p = Path(source)
        if p.is_dir():
            return sorted(f for f in p.rglob("*") if f.is_file()), False
        return [p], True
    return [Path(f) for f in source], True


def _header(path: Path, explicit: bool) -> Dataset | None:
    """The header with pixel data deferred; None for a file found in a folder that is no
    slice (not an image, a scout, a dose screen: :func:`not_a_slice`)."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(path, defer_size=DEFER_BYTES)
    except InvalidDicomError as exc:
        if explicit:
            raise InputError(path, "a DICOM file ('DICM' at byte 128)", str(exc)) from exc
        return None
    except Exception as exc:  # truncated or corrupt headers raise many types
        raise InputError(path, "a readable DICOM file", f"{type(exc).__name__}: {exc}") from exc
    if "PixelData" not in ds:
        if explicit:
            raise InputError(path, "a DICOM image", "no PixelData element")
        return None
    return None if not explicit and not_a_slice(ds) else ds


def _check_pixels(path: Path, ds: Dataset) -> None:
    """Refuse a slice whose header claims more pixel bytes than its file holds."""
    frames = int(ds.get("NumberOfFrames") or 1)
    if frames != 1:
        raise InputError(path, "single-frame CT slices", f"{frames} frames (multi-frame CT)")
    if "ModalityLUTSequence" in ds:
        raise InputError(path, "RescaleSlope/RescaleIntercept", "a Modality LUT Sequence")
    rows, cols = int(ds.get("Rows") or 0), int(ds.get("Columns") or 0)
    samples, bits = int(ds.get("SamplesPerPixel") or 1), int(ds.get("BitsAllocated") or 0)
    if rows < 1 or cols < 1 or samples != 1 or bits not in (8, 16, 32):
        raise InputError(
            path,
            "a grayscale image: Rows, Columns ≥ 1, 1 sample of 8, 16 or 32 bits",
            f"{rows}×{cols}, {samples} samples of {bits} bits",
        )
    needed, size = rows * cols * bits // 8, path.stat().st_size
    what = f"{rows}×{cols} pixels of {bits} bits"
    syntax = ds.file_meta.get("TransferSyntaxUID")
    if syntax is not None and (syntax.is_encapsulated or syntax.is_deflated):
        # Deflated: the whole data set is compressed, and the deferred element's offset
        # and length are those in the inflated stream, not in the file.
        limit = max(MAX_INFLATE_RATIO * size, MIN_COMPRESSED_ALLOWANCE)
        require_bytes(path, needed, limit, f"{what} (decoded from a {size}-byte file)")
        return
    elem = ds.get_item("PixelData", keep_deferred=True)
    if elem.value is None:  # deferred: the header gives the length and where it starts
        require_bytes(path, needed, elem.length, f"{what} in PixelData")
        require_bytes(path, elem.value_tell + elem.length, size, "the PixelData it declares")
    else:
        require_bytes(path, needed, len(elem.value), f"{what} in PixelData")


def _rescale_tags(slices: list[tuple[Path, Dataset]]) -> bool:
    """Whether the slices carry RescaleSlope/RescaleIntercept (all of them, or none)."""
    tagged = ["RescaleSlope" in ds and "RescaleIntercept" in ds for _, ds in slices]
    if any(tagged) and not all(tagged):
        path = slices[tagged.index(False)][0]
        raise InputError(path, "RescaleSlope/RescaleIntercept like the rest of its series", "none")
    return all(tagged)


def _numbers(
    path: Path, ds: Dataset, tag: str, count: int, default: Sequence[float] | None = None
) -> np.ndarray:
    """``count`` finite numbers from ``tag`` (``default`` when the tag is absent); an empty
    or malformed value names the file instead of failing deep inside numpy."""
    if tag not in ds and default is not None:
        return np.array(default, dtype=float)
    value = ds.get(tag)
    values = [value] if count == 1 and not isinstance(value, list | tuple) else value
    try:
        out = np.array([float(v) for v in values], dtype=float)
    except (TypeError, ValueError):
        out = np.array([])
    if out.shape != (count,) or not np.isfinite(out).all():
        raise InputError(path, f"{count} number{'s' * (count > 1)} in {tag}", repr(value))
    return out


def _grid(slices: list[tuple[Path, Dataset]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row and column direction cosines, pixel spacing (dy, dx), positions (n, 3)) after
    checking that all slices form one grid."""
    first_path, first = slices[0]
    orient = _numbers(first_path, first, "ImageOrientationPatient", 6, [1, 0, 0, 0, 1, 0])
    if "PixelSpacing" not in first:
        raise InputError(first_path, "PixelSpacing (mm between pixel centres)", "none")
    spacing = _numbers(first_path, first, "PixelSpacing", 2)
    cosines = orient.reshape(2, 3)
    unit = np.allclose(np.linalg.norm(cosines, axis=1), 1, atol=1e-2)
    if not (spacing > 0).all() or not unit or abs(np.dot(*cosines)) > 1e-3:
        expected = "positive PixelSpacing, two orthogonal unit cosines in ImageOrientationPatient"
        raise InputError(first_path, expected, f"{spacing.tolist()}, {orient.tolist()}")
    positions = []
    for path, ds in slices:
        if (ds.Rows, ds.Columns) != (first.Rows, first.Columns):
            raise InputError(
                path, f"{first.Rows}×{first.Columns} pixels like {first_path}",
                f"{ds.Rows}×{ds.Columns}",
            )  # fmt: skip
        own = _numbers(path, ds, "ImageOrientationPatient", 6, orient)
        if not np.allclose(own, orient, atol=1e-4):
            raise InputError(path, f"orientation {orient.tolist()} like {first_path}", str(own))
        if not np.allclose(_numbers(path, ds, "PixelSpacing", 2, spacing), spacing):
            raise InputError(path, f"pixel spacing {spacing.tolist()} like {first_path}",
                             str(ds.get("PixelSpacing")))  # fmt: skip
        if len(slices) == 1 and not ds.get("ImagePositionPatient"):
            positions.append(np.zeros(3))  # one slice: where it lies changes nothing here
            continue
        if "ImagePositionPatient" not in ds:
            raise InputError(path, "ImagePositionPatient on every slice of a series", "none")
        positions.append(_numbers(path, ds, "ImagePositionPatient", 3))
    return orient, spacing, np.array(positions)


def _slice_gap(files: list[Path], positions: np.ndarray, normal: np.ndarray,
               pixel: float) -> float:  # fmt: skip
    """The gap between slices (mm), after refusing slices that are not one evenly spaced
    stack along the slice normal: a missing slice would squash the volume, a gantry tilt or a
    stray slice would shear it.  Each position may stray from the fitted stack by a tenth of
    the gap (positions rounded to a few decimals), never by a slice."""
    steps = np.diff(positions, axis=0)
    along = steps @ normal
    sideways = np.linalg.norm(steps - np.outer(along, normal), axis=1)
    for i in np.flatnonzero(sideways > max(0.05 * pixel, 1e-3)):
        tilt = float(np.degrees(np.arctan2(sideways[i], along[i])))
        raise InputError(
            files[i + 1],
            f"a position on the slice normal from {files[i]} (no gantry tilt)",
            f"{sideways[i]:.3f} mm sideways over a {along[i]:.3f} mm step ({tilt:.1f}°)",
        )
    z = positions @ normal
    dz = float(z[-1] - z[0]) / (len(z) - 1)
    stray = z - (z[0] + dz * np.arange(len(z)))
    if np.abs(stray).max() > max(0.1 * dz, 0.02):
        i = int(np.argmax(np.abs(along - np.median(along))))
        raise InputError(
            files[i + 1],
            f"evenly spaced slices, {float(np.median(along)):.4g} mm apart (the median gap)",
            f"{along[i]:.4g} mm from {files[i]} (a missing or extra slice?)",
        )
    return dz


def _affine(orient: np.ndarray, spacing: np.ndarray, origin: np.ndarray, normal: np.ndarray,
            dz: float) -> np.ndarray:  # fmt: skip
    """RAS+ affine of voxel (column i, row j, slice k): DICOM's patient axes are LPS."""
    lps = np.eye(4)
    lps[:3, 0] = orient[:3] * spacing[1]  # along a row: the next column
    lps[:3, 1] = orient[3:] * spacing[0]  # along a column: the next row
    lps[:3, 2] = normal * dz
    lps[:3, 3] = origin
    return np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps


def read_dicom_series(
    source: str | Path | Iterable[str | Path], series_uid: str | None = None
) -> Volume:
    """Read one CT series from a folder or a list of files into HU (z, y, x) float32.

    Slices are sorted along the slice normal (from ImageOrientationPatient) by
    ImagePositionPatient; z spacing is the median gap between positions (SliceThickness for a
    single slice).  In a folder, files that are not DICOM images (DICOMDIR, notes) are
    skipped; a given list must hold only images.  Several series in one folder need
    ``series_uid``.
    """
    import nibabel as nib

    files, explicit = _files(source)
    slices = [(f, ds) for f in files if (ds := _header(f, explicit)) is not None]
    if not slices:
        raise InputError(source, "DICOM files with pixel data", f"none among {len(files)} files")
    uids = sorted({str(ds.get("SeriesInstanceUID", "")) for _, ds in slices})
    if series_uid is None and len(uids) > 1:
        raise InputError(source, "one DICOM series (or pass series_uid)", f"{len(uids)} series")
    if series_uid is not None:
        slices = [(f, ds) for f, ds in slices if str(ds.get("SeriesInstanceUID")) == series_uid]
        if not slices:
            raise InputError(source, f"series {series_uid}", f"series {uids}")
    for f, ds in slices:
        _check_pixels(f, ds)
    orient, spacing, points = _grid(slices)
    normal = np.cross(orient[:3], orient[3:])
    normal /= np.linalg.norm(normal)
    rows, cols = int(slices[0][1].Rows), int(slices[0][1].Columns)
    order = np.argsort(points @ normal, kind="stable")
    z = points[order] @ normal
    for a, b, gap in zip(order[:-1], order[1:], np.diff(z), strict=True):
        if gap < POSITION_TOLERANCE_MM:
            raise InputError(
                slices[b][0], "one slice per position", f"the position of {slices[a][0]}"
            )
    if len(slices) > 1:
        files = [slices[i][0] for i in order]
        dz = _slice_gap(files, points[order], normal, float(spacing.min()))
    else:
        thickness = slices[0][1].get("SliceThickness")
        if not thickness:
            raise InputError(slices[0][0], "SliceThickness for a single-slice series", "none")
        dz = float(_numbers(slices[0][0], slices[0][1], "SliceThickness", 1)[0])
    tagged = _rescale_tags(slices)
    shape = (len(slices), rows, cols)
    what = f"a {'×'.join(map(str, shape))} float32 series volume"
    require_allocatable(slices[0][0].parent, claimed_bytes(shape, 4), what)
    volume = np.empty(shape, dtype=np.float32)
    padding = None
    for out_i, in_i in enumerate(order):
        f, ds = slices[in_i]
        try:
            pixels = _decode(f, ds)
        except Exception as exc:  # missing decoder plugins, corrupt pixel data, …
            raise InputError(f, "decodable pixel data", f"{type(exc).__name__}: {exc}") from exc
        if pixels.shape != (rows, cols):
            raise InputError(f, f"{rows}×{cols} pixels", f"pixel data of shape {pixels.shape}")
        pad = _padding(ds, pixels)
        if pad is not None:
            if padding is None:
                padding = np.zeros(volume.shape, dtype=bool)
            padding[out_i] = pad
        slope = _numbers(f, ds, "RescaleSlope", 1, [1.0])[0]
        intercept = _numbers(f, ds, "RescaleIntercept", 1, [0.0])[0]
        np.multiply(pixels, np.float32(slope), out=volume[out_i], casting="unsafe")
        volume[out_i] += np.float32(intercept)
    # (slice, row, column) is (k, j, i); brought to (S, A, R) like every NIfTI.
    on_disk = _affine(orient, spacing, points[order[0]], normal, dz)
    zooms = (float(spacing[1]), float(spacing[0]), dz)
    data, affine, zyx = to_ras(volume.transpose(2, 1, 0), on_disk, zooms)
    if padding is not None:
        padding = to_ras(padding.transpose(2, 1, 0), on_disk, zooms)[0]
    axis, direction = nib.orientations.io_orientation(on_disk)[2]
    if axis == 2 and direction < 0:  # slices run to the feet: list them as data's z runs
        order, z = order[::-1], z[::-1]
    return Volume(
        data=data,
        spacing=zyx,
        source=str(source) if isinstance(source, str | Path) else str(slices[0][0].parent),
        claims={"dicom": IDENTITY} if tagged else {},
        padding=padding,
        affine=affine,
        meta={
            "slices": len(slices),
            "series_uid": uids[0] if series_uid is None else series_uid,
            # Along data's z for axial series; along the slice normal for any other.
            "slice_positions_mm": z.tolist(),
            "orientation_on_disk": "".join(nib.aff2axcodes(on_disk)),
            "orientation": "".join(nib.aff2axcodes(affine)),
            "files": [str(slices[i][0]) for i in order],
        },
    )


def _decode(path: Path, ds: Dataset) -> np.ndarray:
    """The stored pixel values of one slice.  ``pixel_array`` reads them from the file, but
    finds none in a deflated one: that slice is read whole, inflated, and decoded from it."""
    import pydicom
    from pydicom.pixels import pixel_array

    syntax = ds.file_meta.get("TransferSyntaxUID")
    if syntax is not None and syntax.is_deflated:
        return pydicom.dcmread(path).pixel_array
    return pixel_array(path)


def _padding(ds: Dataset, pixels: np.ndarray) -> np.ndarray | None:
    """Pixels equal to PixelPaddingValue, or within it and PixelPaddingRangeLimit."""
    value = ds.get("PixelPaddingValue")
    if value is None:
        return None
    limit = ds.get("PixelPaddingRangeLimit", value)
    if int(ds.get("PixelRepresentation") or 0) == 1:  # signed pixels, a value written as US
        bits = int(ds.get("BitsAllocated") or 16)
        value, limit = (int(v) - (1 << bits) if int(v) >= 1 << (bits - 1) else v
                        for v in (value, limit))  # fmt: skip
    lo, hi = min(value, limit), max(value, limit)
    mask = (pixels >= lo) & (pixels <= hi)
    return mask if mask.any() else None


DICOM_SUFFIXES = (".dcm", ".dicom", ".ima")
_SERIES_UID = 0x0020000E
_DICOMDIR_CLASS = "1.2.840.10008.1.3.10"
# Storage classes that are no CT slice but sit beside series: structured reports (dose
# reports), presentation states, documents, raw data and registrations, waveforms, RT,
# secondary captures (dose screens; 7 and its multi-frame 7.x, and visible light 77.x).
_NOT_SLICES = tuple(f"1.2.840.10008.5.1.4.1.1.{c}" for c in
                    ("88.", "11.", "104.", "66", "9.", "481.", "7"))  # fmt: skip
NOT_A_SLICE = "-"  # no UID is "-": UIDs are digits and dots


def not_a_slice(ds: Dataset) -> bool:
    """Whether ``ds`` is no slice of a CT volume: a DICOMDIR, an object of a storage class
    in ``_NOT_SLICES``, or a scout (ImageType LOCALIZER: a projection image, in another
    orientation than the slices, often in their series)."""
    sop_class = str(ds.file_meta.get("MediaStorageSOPClassUID") or ds.get("SOPClassUID") or "")
    if sop_class == _DICOMDIR_CLASS or sop_class.startswith(_NOT_SLICES):
        return True
    image_type = ds.get("ImageType") or []
    image_type = [image_type] if isinstance(image_type, str) else image_type
    return "LOCALIZER" in (str(v).strip().upper() for v in image_type)


def looks_like_dicom(path: Path) -> bool:
    """Whether ``path`` has the DICOM preamble mark: ``DICM`` at byte 128."""
    try:
        with open(path, "rb") as f:
            f.seek(128)
            return f.read(4) == b"DICM"
    except OSError:
        return False


@functools.lru_cache(maxsize=1 << 18)
def _series_uid(path: str, size: int, mtime_ns: int) -> str | None:
    """SeriesInstanceUID from the start of the header; "" for a non-DICOM file,
    ``NOT_A_SLICE`` for a DICOMDIR, a report or another object that is no slice, None for a
    DICOM file whose header cannot be read.  Cached by size and mtime: a sensor that walks
    the same folders every tick reads each header once."""
    from pydicom.errors import InvalidDicomError
    from pydicom.filereader import read_partial

    try:
        with open(path, "rb") as f:
            ds = read_partial(f, stop_when=lambda tag, vr, length: tag > _SERIES_UID)
    except InvalidDicomError:
        return ""
    except Exception:  # truncated or corrupt: the series reader names the problem
        return None
    if not_a_slice(ds):
        return NOT_A_SLICE
    return str(ds.get("SeriesInstanceUID") or "") or None


def group_series(files: Iterable[Path]) -> tuple[dict[str, list[Path]], list[Path]]:
    """(SeriesInstanceUID → its files, broken files) among ``files``.  Broken: a DICOM
    header that cannot be read, or a ``.dcm`` file that is not DICOM; other files that are
    no DICOM image (notes, DICOMDIR, dose reports) are left out."""
    series: dict[str, list[Path]] = {}
    broken = []
    for path in files:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # removed since the folder was listed
        uid = _series_uid(str(path), st.st_size, st.st_mtime_ns)
        if uid == NOT_A_SLICE:
            continue
        if uid:
            series.setdefault(uid, []).append(path)
        elif uid is None or path.suffix.lower() in DICOM_SUFFIXES:
            broken.append(path)  # a .dcm file that is no DICOM image is broken too
    return series, broken


def write_dicom_series(
    folder: str | Path,
    stored: np.ndarray,
    spacing_zyx: tuple[float, float, float],
    intercept: float = -1024.0,
    padding_value: int | None = None,
    seed: str = "zarrfeed",
) -> list[Path]:
    """Write (z, y, x) = (S, A, R) int16 stored values as a head-first supine axial CT
    series (rows run to the patient's left, columns to the back, as scanners store them), one
    suffix-less file per slice as many scanners name them, with deterministic UIDs (used for
    sample data); :func:`read_dicom_series` gives the same array back."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    study, series = (generate_uid(entropy_srcs=[seed, part]) for part in ("study", "series"))
    paths = []
    for i, plane in enumerate(np.asarray(stored, dtype="<i2")[:, ::-1, ::-1]):
        sop = generate_uid(entropy_srcs=[seed, "slice", str(i)])
        ds = Dataset()
        ds.file_meta = FileMetaDataset()
        ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = CTImageStorage
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = sop
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.Modality = study, series, "CT"
        ds.InstanceNumber, ds.Rows, ds.Columns = i + 1, *plane.shape
        ds.ImagePositionPatient = [0.0, 0.0, i * spacing_zyx[0]]
        ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
        ds.PixelSpacing, ds.SliceThickness = list(spacing_zyx[1:]), spacing_zyx[0]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType = 1, intercept, "HU"
        if padding_value is not None:
            ds.PixelPaddingValue = padding_value
        ds.PixelData = np.ascontiguousarray(plane).tobytes()
        paths.append(folder / f"IM{i + 1:04d}")
        ds.save_as(paths[-1], enforce_file_format=True)
    return paths
