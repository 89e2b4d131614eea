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
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pydicom
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.errors import InvalidDicomError
from pydicom.filereader import read_partial
from pydicom.pixels import pixel_array
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

from zarrfeed.errors import InputError
from zarrfeed.formats.limits import MAX_INFLATE_RATIO, require_bytes
from zarrfeed.formats.volume import Volume
from zarrfeed.transforms.hu import IDENTITY

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
    """The header with pixel data deferred; None for a non-image file found in a folder."""
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
    return ds


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
    if syntax is not None and syntax.is_encapsulated:
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


def _grid(slices: list[tuple[Path, Dataset]]) -> tuple[np.ndarray, tuple[float, float]]:
    """Positions along the slice normal, after checking that all slices form one grid."""
    first_path, first = slices[0]
    orient = np.array(first.get("ImageOrientationPatient", [1, 0, 0, 0, 1, 0]), dtype=float)
    spacing = first.get("PixelSpacing")
    if spacing is None:
        raise InputError(first_path, "PixelSpacing (mm between pixel centres)", "none")
    normal = np.cross(orient[:3], orient[3:])
    positions = []
    for path, ds in slices:
        if (ds.Rows, ds.Columns) != (first.Rows, first.Columns):
            raise InputError(
                path, f"{first.Rows}×{first.Columns} pixels like {first_path}",
                f"{ds.Rows}×{ds.Columns}",
            )  # fmt: skip
        own = np.array(ds.get("ImageOrientationPatient", orient), dtype=float)
        if not np.allclose(own, orient, atol=1e-4):
            raise InputError(path, f"orientation {orient.tolist()} like {first_path}", str(own))
        if not np.allclose(np.array(ds.get("PixelSpacing", spacing), float), spacing):
            raise InputError(path, f"pixel spacing {spacing} like {first_path}",
                             str(ds.get("PixelSpacing")))  # fmt: skip
        pos = ds.get("ImagePositionPatient")
        if pos is None and len(slices) > 1:
            raise InputError(path, "ImagePositionPatient on every slice of a series", "none")
        positions.append(float(np.dot(normal, np.array(pos, dtype=float))) if pos else 0.0)
    return np.array(positions), (float(spacing[0]), float(spacing[1]))


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
    positions, (dy, dx) = _grid(slices)
    rows, cols = int(slices[0][1].Rows), int(slices[0][1].Columns)
    order = np.argsort(positions, kind="stable")
    z = positions[order]
    for a, b, gap in zip(order[:-1], order[1:], np.diff(z), strict=True):
        if gap < POSITION_TOLERANCE_MM:
            raise InputError(
                slices[b][0], "one slice per position", f"the position of {slices[a][0]}"
            )
    tagged = _rescale_tags(slices)
    volume = np.empty((len(slices), rows, cols), dtype=np.float32)
    padding = None
    for out_i, in_i in enumerate(order):
        f, ds = slices[in_i]
        try:
            pixels = pixel_array(f)
        except Exception as exc:  # missing decoder plugins, corrupt pixel data, …
            raise InputError(f, "decodable pixel data", f"{type(exc).__name__}: {exc}") from exc
        if pixels.shape != (rows, cols):
            raise InputError(f, f"{rows}×{cols} pixels", f"pixel data of shape {pixels.shape}")
        pad = _padding(ds, pixels)
        if pad is not None:
            if padding is None:
                padding = np.zeros(volume.shape, dtype=bool)
            padding[out_i] = pad
        slope = float(ds.get("RescaleSlope", 1.0))
        intercept = float(ds.get("RescaleIntercept", 0.0))
        np.multiply(pixels, np.float32(slope), out=volume[out_i], casting="unsafe")
        volume[out_i] += np.float32(intercept)
    if len(slices) > 1:
        gaps = np.diff(z)
        dz = float(np.median(gaps))
        irregular = bool(np.ptp(gaps) > 0.01 * dz)
    else:
        thickness = slices[0][1].get("SliceThickness")
        if not thickness:
            raise InputError(slices[0][0], "SliceThickness for a single-slice series", "none")
        dz, irregular = float(thickness), False
    return Volume(
        data=volume,
        spacing=(dz, dy, dx),
        source=str(source) if isinstance(source, str | Path) else str(slices[0][0].parent),
        claims={"dicom": IDENTITY} if tagged else {},
        padding=padding,
        meta={
            "slices": len(slices),
            "series_uid": uids[0] if series_uid is None else series_uid,
            "slice_positions_mm": z.tolist(),
            "irregular_spacing": irregular,
            "files": [str(slices[i][0]) for i in order],
        },
    )


def _padding(ds: Dataset, pixels: np.ndarray) -> np.ndarray | None:
    """Pixels equal to PixelPaddingValue, or within it and PixelPaddingRangeLimit."""
    value = ds.get("PixelPaddingValue")
    if value is None:
        return None
    limit = ds.get("PixelPaddingRangeLimit", value)
    lo, hi = min(value, limit), max(value, limit)
    mask = (pixels >= lo) & (pixels <= hi)
    return mask if mask.any() else None


DICOM_SUFFIXES = (".dcm", ".dicom", ".ima")
_SERIES_UID = 0x0020000E
_DICOMDIR_CLASS = "1.2.840.10008.1.3.10"


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
    """SeriesInstanceUID from the start of the header; "" for a DICOMDIR or a non-DICOM file,
    None for a DICOM file whose header cannot be read.  Cached by size and mtime: a sensor
    that walks the same folders every tick reads each header once."""
    try:
        with open(path, "rb") as f:
            ds = read_partial(f, stop_when=lambda tag, vr, length: tag > _SERIES_UID)
    except InvalidDicomError:
        return ""
    except Exception:  # truncated or corrupt: the series reader names the problem
        return None
    if ds.file_meta.get("MediaStorageSOPClassUID") == _DICOMDIR_CLASS:
        return ""
    return str(ds.get("SeriesInstanceUID") or "") or None


def group_series(files: Iterable[Path]) -> tuple[dict[str, list[Path]], list[Path]]:
    """(SeriesInstanceUID → its files, broken files) among ``files``.  Broken: a DICOM
    header that cannot be read, or a ``.dcm`` file that is not DICOM; other files that are
    no DICOM image (notes, DICOMDIR) are left out."""
    series: dict[str, list[Path]] = {}
    broken = []
    for path in files:
        st = path.stat()
        uid = _series_uid(str(path), st.st_size, st.st_mtime_ns)
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
    """Write (z, y, x) int16 stored values as a CT series, one suffix-less file per slice
    as many scanners name them, with deterministic UIDs (used for sample data)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    study, series = (generate_uid(entropy_srcs=[seed, part]) for part in ("study", "series"))
    paths = []
    for i, plane in enumerate(np.asarray(stored, dtype="<i2")):
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
        ds.PixelData = plane.tobytes()
        paths.append(folder / f"IM{i + 1:04d}")
        ds.save_as(paths[-1], enforce_file_format=True)
    return paths
