"""CT-RATE's tables beside the scans: metadata (rescale, spacing), labels and reports.

Every table is read as UTF-8, with or without the byte order mark spreadsheet programs
write; rows are keyed by the VolumeName's stem (``train_1_a_1``), the key discovery gives
the volume.
"""

from __future__ import annotations

import csv
import fnmatch
from pathlib import Path

from zarrfeed.errors import InputError
from zarrfeed.formats.ct import ct_stem
from zarrfeed.formats.walk import Tree, walk_tree

UNKNOWN_LABEL = 255  # a CT-RATE label table's value where a scan has no label row
MEMO = "ct-rate-metadata"  # the name of the parsed CSVs in the walk's cache
# A metadata CSV's path → (its size and mtime when parsed, its rows).
Parsed = dict[Path, tuple[tuple[int, int], dict[str, dict[str, str]]]]


def read_ct_rate_metadata(
    root: str | Path, tree: Tree | None = None, skipped: dict[str, str] | None = None
) -> dict[str, dict[str, str]]:
    """VolumeName stem → CT-RATE metadata row, from every ``*metadata*.csv`` under ``root``
    (found in ``tree``, :func:`walk_tree`'s, when the caller has it).  The CT-RATE tables are
    read as UTF-8, with or without the byte order mark spreadsheet programs write.  A CSV that
    cannot be read raises :class:`InputError`, or, given ``skipped``, is recorded there and
    left out."""
    tree = walk_tree(root) if tree is None else tree
    parsed = tree.cache.derived.get(MEMO, {})
    kept: Parsed = {}
    rows: dict[str, dict[str, str]] = {}
    for folder, names in tree.items():
        for name in names:
            if fnmatch.fnmatchcase(name, "*metadata*.csv"):
                try:
                    rows.update(_metadata_rows(folder / name, parsed, kept))
                except (InputError, OSError, UnicodeDecodeError, csv.Error) as exc:
                    if skipped is None:
                        raise
                    skipped[str(folder / name)] = str(exc)
    tree.cache.derived[MEMO] = kept
    return rows


def _metadata_rows(csv_path: Path, parsed: Parsed, kept: Parsed) -> dict[str, dict[str, str]]:
    """The rows of one metadata CSV, taken from ``parsed`` (the last walk's) unless its
    size or mtime changed since, and recorded in ``kept``: a discovery sensor reads the same
    50,000-row CSV on every tick."""
    st = csv_path.stat()
    stamp = (st.st_size, st.st_mtime_ns)
    if csv_path in parsed and parsed[csv_path][0] == stamp:
        kept[csv_path] = parsed[csv_path]
        return parsed[csv_path][1]
    rows = {}
    with open(csv_path, newline="", encoding="utf-8-sig") as f:
        # csv.reader and zip, not DictReader: a third of the time for a 50,000-row CSV.
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or "VolumeName" not in header:
            raise InputError(csv_path, "a CT-RATE metadata CSV with VolumeName", str(header))
        at, width = header.index("VolumeName"), len(header)
        for values in reader:
            if not values:
                continue  # a blank line, as DictReader skips it
            if len(values) < width:  # DictReader's missing values
                values = values + [None] * (width - len(values))
            rows[ct_stem(values[at])] = dict(zip(header, values, strict=False))
    kept[csv_path] = (stamp, rows)
    return rows


def read_ct_rate_labels(root: str | Path) -> tuple[list[str], dict[str, list[int]]]:
    """(label names, VolumeName stem → 0/1 row) from every ``*labels*.csv`` under ``root``."""
    names: list[str] = []
    rows: dict[str, list[int]] = {}
    for csv_path in sorted(Path(root).rglob("*labels*.csv")):
        with open(csv_path, newline="", encoding="utf-8-sig") as f:
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
                rows[ct_stem(Path(row["VolumeName"]))] = _label_row(csv_path, row, names)
    return names, rows


def _label_row(csv_path: Path, row: dict[str, str | None], names: list[str]) -> list[int]:
    """A row's labels, each 0 or 1 (``1.0`` and ``0.0`` too): a probability or an
    "uncertain" -1 is no label, and a short row no row."""
    values = []
    for name in names:
        text = row.get(name)
        try:
            value = float(text) if text is not None else None
        except ValueError:
            value = None
        if value not in (0.0, 1.0):
            found = f"no value for {name}" if text is None else f"{name} = {text!r}"
            raise InputError(csv_path, "0/1 labels", f"{row['VolumeName']}: {found}")
        values.append(int(value))
    return values


def read_ct_rate_reports(root: str | Path) -> dict[str, str]:
    """VolumeName stem → findings and impressions, from every ``*reports*.csv`` under ``root``
    (CT-CLIP reads these two columns; "Not given." is kept as written)."""
    reports: dict[str, str] = {}
    for csv_path in sorted(Path(root).rglob("*reports*.csv")):
        with open(csv_path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "VolumeName" not in reader.fieldnames:
                raise InputError(
                    csv_path, "a CT-RATE report CSV with VolumeName", str(reader.fieldnames)
                )
            for row in reader:
                text = (row.get(c) or "" for c in ("Findings_EN", "Impressions_EN"))
                reports[ct_stem(Path(row["VolumeName"]))] = "\n\n".join(text)
    return reports
