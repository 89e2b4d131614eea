"""Finding raw inputs in a folder and the CT-RATE metadata that goes with them."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
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


def read_ct_rate_labels(root: str | Path) -> tuple[list[str], dict[str, list[int]]]:
    """(label names, VolumeName stem → 0/1 row) from every ``*labels*.csv`` under ``root``."""
    names: list[str] = []
    rows: dict[str, list[int]] = {}
    for csv_path in sorted(Path(root).rglob("*labels*.csv")):
        with open(csv_path, newline="") as f:
            reader = csv.DictReader(f)
            columns = [c for c in reader.fieldnames or [] if c != "VolumeName"]
            if not reader.fieldnames or "VolumeName" not in reader.fieldnames or not columns:
                raise InputError(csv_path, "a CT-RATE label CSV: VolumeName + label columns",
                                 str(reader.fieldnames))  # fmt: skip
            if names and columns != names:
                raise InputError(
                    csv_path, f"the label columns of the other CSVs {names}", str(columns)
                )
            names = columns
            for row in reader:
                try:
                    rows[ct_stem(Path(row["VolumeName"]))] = [int(float(row[c])) for c in names]
                except ValueError as exc:
                    raise InputError(csv_path, "0/1 labels", f"{row['VolumeName']}: {exc}") from exc
    return names, rows


def read_ct_rate_reports(root: str | Path) -> dict[str, str]:
    """VolumeName stem → findings and impressions, from every ``*reports*.csv`` under ``root``
    (CT-CLIP reads these two columns; "Not given." is kept as written)."""
    reports: dict[str, str] = {}
    for csv_path in sorted(Path(root).rglob("*reports*.csv")):
        with open(csv_path, newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "VolumeName" not in reader.fieldnames:
                raise InputError(
                    csv_path, "a CT-RATE report CSV with VolumeName", str(reader.fieldnames)
                )
            for row in reader:
                text = (row.get(c) or "" for c in ("Findings_EN", "Impressions_EN"))
                reports[ct_stem(Path(row["VolumeName"]))] = "\n\n".join(text)
    return reports


def rescale_from_metadata(row: dict[str, str] | None) -> tuple[float, float]:
    """(slope, intercept) from a metadata row; (1, 0) when there is none."""
    if not row:
        return 1.0, 0.0
    return float(row.get("RescaleSlope") or 1.0), float(row.get("RescaleIntercept") or 0.0)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
SPIKE_FOLDERS = ("spike_packed", "spike")  # preferred first: the camera's own packed stream


@dataclass(frozen=True)
class SpikeSequence:
    """One spike sequence folder and the facts its dataset's ``dataset.json`` gives."""

    folder: Path
    height: int
    width: int
    spike_folder: str
    layout: str
    frames: int

    def samples(self) -> list[str]:
        """Sample stems present in every modality (spike, blur, sharp), sorted."""
        stems = [
            {p.stem for p in (self.folder / sub).glob(pattern)}
            for sub, pattern in (
                (self.spike_folder, "*.dat"),
                ("blur", "*.png"),
                ("sharp", "*.png"),
            )
        ]
        return sorted(set.intersection(*stems))

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.rglob("*") if p.is_file())


def _relative_key(path: Path, root: Path) -> str:
    return sanitise_key("_".join(path.relative_to(root).parts))


def find_spike_sequences(root: str | Path) -> dict[str, SpikeSequence]:
    """Partition key → sequence, for every sequence of every spike dataset under ``root``.

    A spike dataset is a folder with a ``dataset.json`` (height, width, per-folder layout and
    frame count, as the sample generator and SpikeZoo's configs give them); its sequences are
    the folders below it holding a ``spike_packed/`` or ``spike/`` folder.  The key is the
    path from the dataset folder (``train_GOPR0372_07_00``).
    """
    found: dict[str, SpikeSequence] = {}
    for config in sorted(Path(root).rglob("dataset.json")) if Path(root).exists() else []:
        facts = _spike_config(config)
        for sub in SPIKE_FOLDERS:
            if sub not in facts["layouts"]:
                continue
            for folder in sorted(p.parent for p in config.parent.rglob(sub) if p.is_dir()):
                key = _relative_key(folder, config.parent)
                if key in found:
                    continue  # the folder also has the preferred layout
                layout = facts["layouts"][sub]
                found[key] = SpikeSequence(
                    folder, facts["height"], facts["width"], sub, layout["layout"], layout["frames"]
                )
    return found


def _spike_config(path: Path) -> dict:
    try:
        facts = json.loads(path.read_text())
        int(facts["height"]), int(facts["width"])
        for entry in facts["layouts"].values():
            entry["layout"], int(entry["frames"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(
            path,
            'JSON with "height", "width" and "layouts": {folder: {"layout", "frames"}}',
            f"{type(exc).__name__}: {exc}",
        ) from exc
    return facts


def find_image_sets(root: str | Path) -> dict[str, Path]:
    """Partition key → folder, for every folder holding images directly.

    Folders inside a spike dataset (its ``blur/`` and ``sharp/`` frames) belong to that family
    and are left out.  The key is the folder's path under ``root`` (``inspection_train``).
    """
    root = Path(root)
    if not root.exists():
        return {}
    spike_roots = [p.parent for p in root.rglob("dataset.json")]
    folders = {p.parent for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES}
    return {
        _relative_key(f, root): f
        for f in sorted(folders)
        if not any(f.is_relative_to(s) for s in spike_roots)
    }


def image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
