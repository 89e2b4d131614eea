"""Finding CT items under a raw folder, and their catalog entries.

Files are classified by name (:func:`discover_ct`), and only DICOM needs a look inside: one
file per folder without ``.dcm`` suffixes is sniffed for ``DICM`` at byte 128, and in DICOM
folders each file's header start is read once (cached by size and mtime) for its
SeriesInstanceUID.

Keys: NIfTI and ``.npy``/``.npz`` volumes are the file name without suffix
(``train_1_a_1``, the CT-RATE name the metadata CSV joins on); a DICOM series is its
folder's path under the root (``dicom_patient7_CT``), since series folders are rarely named
uniquely, with ``_<SeriesInstanceUID>`` appended when the folder holds several series and
``_<file name>`` for a file whose header cannot be read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from zarrfeed.families.ct.tables import read_ct_rate_metadata
from zarrfeed.formats.ct import ARRAY_SUFFIXES, CT_SUFFIXES, CTItem, ct_stem
from zarrfeed.formats.dicom import DICOM_SUFFIXES, group_series, looks_like_dicom
from zarrfeed.formats.walk import Found, Tree, collect, folder_key, item_key, walk_tree
from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import Scan, catalog_entries, is_hub, raw_origin
from zarrfeed.transforms.hu import csv_rescale

MEMO = "ct"  # the name of this finder's memo in the walk's cache


def _bare(name: str) -> bool:
    """No suffix, or a numeric one (``1.2.840.113619.2.55.3.4``): how DICOM slices are
    often named."""
    suffix = os.path.splitext(name)[1]
    return not suffix or suffix[1:].isdigit()


def _dicom_items(root: Path, folder: Path, names: list[str]) -> list[tuple[str, Path, CTItem]]:
    files = [folder / n for n in names if n.lower().endswith(DICOM_SUFFIXES)]
    bare = [folder / n for n in sorted(names) if _bare(n)]
    # A README or CHECKSUMS file may sort first or last: the first, middle and last are
    # sniffed (three opens at most for a folder of other suffix-less files, such as frames).
    sniffed = dict.fromkeys(bare[i] for i in (0, len(bare) // 2, -1)) if bare else {}
    if any(looks_like_dicom(f) for f in sniffed):
        files += bare
    if not files:
        return []
    series, broken = group_series(sorted(files))
    base = folder_key(folder, root, root)
    found = []
    for uid, paths in sorted(series.items()):
        key = base if len(series) == 1 else item_key(f"{base}_{uid}", folder, root)
        found.append((key, folder, CTItem(key, "dicom", folder, tuple(paths), uid)))
    for path in broken:
        key = item_key(f"{base}_{path.name}", path, root)
        found.append((key, path, CTItem(key, "dicom", path, (path,))))
    return found


def discover_ct(root: str | Path, tree: Tree | None = None) -> Found[CTItem]:
    """Every CT item under ``root``: NIfTI files, ``.npy``/``.npz`` volumes and DICOM
    series; ``tree`` is :func:`walk_tree`'s, when the caller has it (less the folders other
    families claim).  A folder whose listing is the very list the cache's last walk gave
    keeps the non-DICOM items derived from it then."""
    root = Path(root)
    tree = walk_tree(root) if tree is None else tree
    known_memo = tree.cache.derived.get(MEMO, {})
    found: list[tuple[str, Path, CTItem]] = []
    memo: dict[Path, tuple[list[str], list, Path]] = {}
    for folder, names in tree.items():
        known = known_memo.get(folder)
        if known is not None and known[0] is names and known[2] == root:
            memo[folder] = known  # the same listing (walk_tree): the same items
            found += known[1]
            continue
        items = _ct_files(root, folder, names)
        dicom = _dicom_items(root, folder, names)
        if not dicom:  # DICOM folders are grouped anew: a rewritten slice may move series
            memo[folder] = (names, items, root)
        found += items + dicom
    tree.cache.derived[MEMO] = memo
    return collect(root, found, tree.skipped)


def _ct_files(root: Path, folder: Path, names: list[str]) -> list:
    """The NIfTI and ``.npy``/``.npz`` items of one folder, their suffixes in any case
    (``CT.NII.GZ``)."""
    found = []
    present = set(names)
    for name in names:
        path, lower = folder / name, name.lower()
        if lower.endswith(CT_SUFFIXES):
            key = item_key(ct_stem(path), path, root)
            found.append((key, path, CTItem(key, "nifti", path)))
        elif lower.endswith(ARRAY_SUFFIXES):
            stem, kind = name[:-4], lower[-3:]
            sidecar = f"{stem}.json"
            files = (path, folder / sidecar) if sidecar in present else ()
            key = item_key(stem, path, root)
            found.append((key, path, CTItem(key, kind, path, files)))
    return found


def scan_ct(
    root: str | Path,
    tree: Tree | None = None,
    metadata: Mapping[str, Mapping[str, str]] | None = None,
) -> Scan:
    """Key → catalog entry for every CT item under ``root`` (NIfTI, DICOM series,
    ``.npy``/``.npz`` volumes), found in ``tree`` when given; ``metadata`` defaults to the
    CT-RATE CSVs found there.  A CT item carries its metadata row's rescale as evidence, so
    an edited CSV makes exactly its scans change."""
    origin = raw_origin(root)
    tree = walk_tree(root) if tree is None else tree  # one walk finds the volumes and the CSVs
    rows = read_ct_rate_metadata(root, tree, tree.skipped) if metadata is None else metadata

    def make(key: str, item: CTItem, size: int, mtime: float) -> RawItem:
        claim = csv_rescale(rows.get(key))
        evidence = {"csv": [claim.slope, claim.intercept]} if claim else {}
        detail = {"files": [str(p) for p in item.files], "series_uid": item.series_uid}
        return RawItem(key, item.kind, str(item.path), origin, size, mtime, evidence, detail)

    found = discover_ct(root, tree)
    return catalog_entries(found, origin, make, lambda item: item.sources())


def ct_item(item: RawItem, local: Path | None = None) -> CTItem:
    """What :func:`zarrfeed.formats.ct.read_ct` reads for a CT entry; ``local`` is where a
    hub volume was downloaded to."""
    if is_hub(item):
        if local is None:
            raise ValueError(f"{item.location}: download the hub volume first")
        return CTItem(item.key, "nifti", local)
    files = tuple(Path(p) for p in item.detail.get("files", ()))
    return CTItem(item.key, item.kind, Path(item.location), files, item.detail.get("series_uid"))


def scan_files(item: RawItem) -> list[Path]:
    """Every local file a CT entry reads."""
    return list(ct_item(item).sources())
