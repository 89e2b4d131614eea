"""DICOM CT series through pydicom: slices ordered by position, rescale applied."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError

from zarrfeed.errors import InputError
from zarrfeed.formats.volume import Volume


def _files(source: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(source, str | Path):
        p = Path(source)
        return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return [Path(f) for f in source]


def read_dicom_series(source: str | Path | Iterable[str | Path], series_uid: str | None = None):
    """Read one CT series from a folder or a list of files into HU (z, y, x) float32.

    Slices are sorted along the slice normal (from ImageOrientationPatient) by
    ImagePositionPatient; z spacing is the median gap between positions (SliceThickness for a
    single slice).  Files without pixel data (DICOMDIR, reports) are skipped; several series
    in one folder need ``series_uid``.
    """
    files = _files(source)
    slices = []
    for f in files:
        try:
            ds = pydicom.dcmread(f)
        except InvalidDicomError:
            continue
        if "PixelData" in ds:
            slices.append((f, ds))
    if not slices:
        raise InputError(source, "DICOM files with pixel data", f"none among {len(files)} files")
    uids = sorted({str(ds.get("SeriesInstanceUID", "")) for _, ds in slices})
    if series_uid is None and len(uids) > 1:
        raise InputError(source, "one DICOM series (or pass series_uid)", f"{len(uids)} series")
    if series_uid is not None:
        slices = [(f, ds) for f, ds in slices if str(ds.get("SeriesInstanceUID")) == series_uid]
        if not slices:
            raise InputError(source, f"series {series_uid}", f"series {uids}")
    first = slices[0][1]
    orient = np.array(first.get("ImageOrientationPatient", [1, 0, 0, 0, 1, 0]), dtype=float)
    normal = np.cross(orient[:3], orient[3:])
    positions = []
    for f, ds in slices:
        if ds.Rows != first.Rows or ds.Columns != first.Columns:
            raise InputError(f, f"{first.Rows}×{first.Columns} pixels", f"{ds.Rows}×{ds.Columns}")
        pos = ds.get("ImagePositionPatient")
        positions.append(float(np.dot(normal, np.array(pos, dtype=float))) if pos else 0.0)
    order = np.argsort(positions, kind="stable")
    z = np.array(positions)[order]
    volume = np.empty((len(slices), int(first.Rows), int(first.Columns)), dtype=np.float32)
    for out_i, in_i in enumerate(order):
        f, ds = slices[in_i]
        try:
            pixels = ds.pixel_array.astype(np.float32)
        except Exception as exc:  # missing decoder plugins, truncated pixel data, …
            raise InputError(f, "decodable pixel data", str(exc)) from exc
        slope = float(ds.get("RescaleSlope", 1.0))
        intercept = float(ds.get("RescaleIntercept", 0.0))
        volume[out_i] = pixels * np.float32(slope) + np.float32(intercept)
    gaps = np.diff(z)
    if len(slices) > 1:
        dz = float(np.median(gaps))
        irregular = bool(np.ptp(gaps) > 0.01 * max(abs(dz), 1e-6))
    else:
        dz, irregular = float(first.get("SliceThickness", 1.0)), False
    dy, dx = (float(v) for v in first.get("PixelSpacing", [1.0, 1.0]))
    return Volume(
        data=volume,
        spacing=(abs(dz), dy, dx),
        source=str(source) if isinstance(source, str | Path) else str(slices[0][0].parent),
        meta={
            "slices": len(slices),
            "series_uid": uids[0] if series_uid is None else series_uid,
            "slice_positions_mm": z.tolist(),
            "irregular_spacing": irregular,
            "files": [str(slices[i][0]) for i in order],
        },
    )
