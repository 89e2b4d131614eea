"""Finding raw inputs in a folder and the CT-RATE metadata that goes with them."""

from __future__ import annotations

import csv
from pathlib import Path

from zarrfeed.errors import InputError
from zarrfeed.store.keys import sanitise_key

CT_SUFFIXES = (".nii.gz", ".nii")


def ct_stem(path: Path) -> str:
    name = path.name
    for suffix in CT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def find_ct_scans(root: str | Path) -> dict[str, Path]:
    """Partition key → NIfTI file for every CT volume under ``root`` (any nesting).

    Keys are sanitised file stems (``train_1_a_1``); two files with one key are an error that
    names both, since one would silently shadow the other.
    """
    found: dict[str, Path] = {}
    root = Path(root)
    if not root.exists():
        return found
    for path in sorted(p for p in root.rglob("*") if p.name.endswith(CT_SUFFIXES) and p.is_file()):
        key = sanitise_key(ct_stem(path))
        if key in found:
            raise InputError(path, f"a unique scan name (key {key!r})", f"also {found[key]}")
        found[key] = path
    return found


def read_ct_rate_metadata(root: str | Path) -> dict[str, dict[str, str]]:
    """VolumeName stem → CT-RATE metadata row, from every ``*metadata*.csv`` under ``root``."""
    rows: dict[str, dict[str, str]] = {}
    for csv_path in sorted(Path(root).rglob("*metadata*.csv")):
        with open(csv_path, newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "VolumeName" not in reader.fieldnames:
                raise InputError(
                    csv_path, "a CT-RATE metadata CSV with VolumeName", str(reader.fieldnames)
                )
            for row in reader:
                rows[ct_stem(Path(row["VolumeName"]))] = row
    return rows


def rescale_from_metadata(row: dict[str, str] | None) -> tuple[float, float]:
    """(slope, intercept) from a metadata row; (1, 0) when there is none."""
    if not row:
        return 1.0, 0.0
    return float(row.get("RescaleSlope") or 1.0), float(row.get("RescaleIntercept") or 0.0)
