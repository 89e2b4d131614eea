"""Finding raw inputs under a folder, and the CT-RATE metadata that goes with them.

One ``os.scandir`` recursion lists the tree; files are classified by name, and only DICOM
needs a look inside: one file per folder without ``.dcm`` suffixes is sniffed for ``DICM``
at byte 128, and in DICOM folders each file's header start is read once (cached by size and
mtime) for its SeriesInstanceUID.

Every entry discovery leaves out is listed with the reason: a hidden one (a name starting
with ``.``, ``..dots.nii.gz`` too, by Unix convention) and, under ``ZARRFEED_RAW_LINKS=inside``
(:func:`links_policy`), a file link whose target lies outside the raw folder.  Other file
links are followed: the item is read at the target, and its provenance records both.

Discovery survives any single broken entry: a symlink loop, a dangling link, a folder it may
not list, a ``dataset.json`` or metadata CSV it cannot parse is skipped and reported with its
path and the reason (``Found.skipped``); every other item is still found.

Every finder returns a :class:`Found`: partition key → item, plus the collisions, keys that
two or more raw items sanitise to (``x y.nii.gz`` and ``x_y.nii.gz``).  A collision neither
fails the whole discovery nor drops one item silently: its partition fails alone, naming
every file (:meth:`Found.get`), and every other item builds.

Keys (``[A-Za-z0-9._-]``, see :func:`zarrfeed.store.keys.sanitise_key`):

* NIfTI and ``.npy``/``.npz`` volumes: the file name without suffix (``train_1_a_1``, the
  CT-RATE name the metadata CSV joins on);
* DICOM series: the folder's path under the root (``dicom_patient7_CT``), since series
  folders are rarely named uniquely; ``_<SeriesInstanceUID>`` is appended when the folder
  holds several series, ``_<file name>`` for a file whose header cannot be read;
* spike sequences: the path under their dataset folder; image sets: the folder's path;
* a name with no usable character: ``item-`` and a digest of its path under the root, so no
  key depends on where the root is mounted.
"""

from __future__ import annotations

import csv
import fnmatch
import hashlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePath, PurePosixPath
from typing import Generic, NamedTuple, TypeVar

from zarrfeed import defaults
from zarrfeed.errors import InputError, InvalidKeyError
from zarrfeed.formats.ct import CTItem
from zarrfeed.formats.dicom import DICOM_SUFFIXES, group_series, looks_like_dicom
from zarrfeed.store.keys import sanitise_key

CT_SUFFIXES = (".nii.gz", ".nii")
ARRAY_SUFFIXES = (".npy", ".npz")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
SPIKE_FOLDERS = ("spike_packed", "spike")  # preferred first: the camera's own packed stream
SPIKE_CONFIG = "dataset.json"
UNKNOWN_LABEL = 255  # a CT-RATE label table's value where a scan has no label row
HIDDEN = "hidden (its name starts with '.'): left out by convention; rename it to build it"
LINK_POLICIES = ("follow", "inside")
T = TypeVar("T")


def links_policy() -> str:
    """``ZARRFEED_RAW_LINKS`` (:data:`zarrfeed.defaults.RAW_LINKS` when unset): ``follow``
    or ``inside``."""
    policy = os.environ.get("ZARRFEED_RAW_LINKS", defaults.RAW_LINKS)
    if policy not in LINK_POLICIES:
        raise ValueError(f"ZARRFEED_RAW_LINKS={policy!r}: expected one of {LINK_POLICIES}")
    return policy


def link_target(path: str | Path, root: str | Path) -> tuple[str, bool] | None:
    """(resolved target, whether it lies inside ``root``) when ``path`` is a symlink, else
    None."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    inside = Path(target).is_relative_to(os.path.realpath(root))
    return target, inside


def refused_link(path: str | Path, root: str | Path) -> str | None:
    """Why the link ``path`` is refused (its target outside ``root`` under
    ``ZARRFEED_RAW_LINKS=inside``), or None when it is no link or is followed."""
    found = link_target(path, root) if links_policy() == "inside" else None
    if found is None or found[1]:
        return None
    return (
        f"a link to {found[0]}, outside the raw folder {root} (ZARRFEED_RAW_LINKS=inside "
        "refuses it: copy the file in, or set ZARRFEED_RAW_LINKS=follow)"
    )


def ct_stem(path: PurePath | str) -> str:
    """The file name without its CT suffix (``.nii.gz`` is one suffix, in any case)."""
    name = path.name if isinstance(path, PurePath) else path.rsplit("/", 1)[-1]
    for suffix in CT_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return PurePosixPath(name).stem


@dataclass(frozen=True)
class Found(Generic[T]):
    """Partition key → raw item, and the keys several raw items share."""

    root: Path
    items: dict[str, T]
    collisions: dict[str, tuple[Path, ...]]
    skipped: dict[str, str] = field(default_factory=dict)  # broken entry's path → why

    def keys(self) -> list[str]:
        """Every partition key, collided ones included (they fail alone when built)."""
        return sorted({*self.items, *self.collisions})

    def get(self, key: str) -> T:
        """The item of ``key``; :class:`InputError` naming every file for a collision."""
        if key in self.collisions:
            first, *others = self.collisions[key]
            raise InputError(
                first,
                f"a raw item of its own for partition key {key!r}",
                "the same key for " + ", ".join(map(str, others)) + " (rename one of them)",
            )
        if key not in self.items:
            raise InputError(self.root, f"a raw item for key {key!r}", "none (removed?)")
        return self.items[key]


def _collect(root: Path, found: Iterable[tuple[str, Path, T]], skipped: dict[str, str]) -> Found[T]:
    """Group (key, source path, item) triples into items and collisions."""
    by_key: dict[str, list[tuple[Path, T]]] = {}
    for key, path, item in found:
        by_key.setdefault(key, []).append((path, item))
    items = {k: v[0][1] for k, v in by_key.items() if len(v) == 1}
    collisions = {k: tuple(sorted(p for p, _ in v)) for k, v in by_key.items() if len(v) > 1}
    return Found(root, dict(sorted(items.items())), dict(sorted(collisions.items())), dict(skipped))


class _Listing(NamedTuple):
    mtime: int
    folders: list[str]
    names: list[str]
    skipped: dict[str, str]  # entry → why it was left out
    links: list[str]  # names of file symlinks
    path: Path


class Tree(dict):
    """:func:`walk_tree`'s result: folder → sorted file names, in path order, and
    ``skipped``: every broken entry met (path → why), so finders can report them."""

    skipped: dict[str, str]


# Folder → its listing as the last walk in this process saw it.
_LISTINGS: dict[str, _Listing] = {}
_SETTLED_NS = 2_000_000_000  # a folder changed less than this ago may change again unseen


def walk_tree(root: str | Path) -> Tree:
    """Folder → sorted file names of every folder under ``root``, in path order.  Hidden
    entries are skipped, and symlinked folders are not followed (no cycles); a missing root
    is an empty tree.  Broken entries (a symlink loop, a dangling link, a folder that cannot
    be listed) and symlinked folders are left out and listed in the result's ``skipped``.

    A discovery sensor walks the same 50,000-file tree every tick, so a folder whose mtime
    (which changes when an entry is added, removed or renamed) is what the last walk in this
    process saw is not listed again — one ``stat`` instead of a scan — unless it changed
    too recently for its mtime to be trusted or held broken entries; its names come back as
    the very same list, so finders may reuse what they derived from it (:func:`discover_ct`).
    Paths stay strings until the end: pathlib's parsing and comparisons cost more than the
    scan at this size.
    """
    global _LISTINGS
    seen: dict[str, _Listing] = {}
    now = time.time_ns()
    stack = [os.fspath(root)] if os.path.isdir(root) else []
    skipped: dict[str, str] = {}
    while stack:
        folder = stack.pop()
        try:
            mtime = os.stat(folder).st_mtime_ns
        except FileNotFoundError:
            continue  # removed while walking
        except OSError as exc:
            skipped[folder] = f"cannot stat the folder: {exc.strerror or exc}"
            continue
        listing = _LISTINGS.get(folder)
        # A folder with broken entries is listed again: a dangling link mends (its target
        # appears, a mount comes back) without changing the folder's mtime.
        if (
            listing is None
            or listing.mtime != mtime
            or any(why != HIDDEN for why in listing.skipped.values())
            or now - mtime <= _SETTLED_NS
        ):
            listing = _Listing(mtime, *_list(folder), Path(folder))
        seen[folder] = listing
        skipped.update(listing.skipped)
        stack.extend(reversed(listing.folders))  # sorted: popped smallest first
    _LISTINGS = seen  # folders gone since are forgotten
    names = {folder: _followed(listing, root, skipped) for folder, listing in seen.items()}
    tree = Tree((listing.path, names[f]) for f, listing in seen.items())  # in path order
    tree.skipped = skipped
    return tree


def _followed(listing: _Listing, root: str | Path, skipped: dict[str, str]) -> list[str]:
    """The listing's file names less the links refused (:func:`refused_link`), which go to
    ``skipped``; the very same list when none is."""
    if not listing.links:
        return listing.names
    refused = {}
    for name in listing.links:
        why = refused_link(os.path.join(listing.path, name), root)
        if why is not None:
            refused[name] = why
    if not refused:
        return listing.names
    skipped.update({os.path.join(listing.path, n): why for n, why in refused.items()})
    return [n for n in listing.names if n not in refused]


def _list(folder: str) -> tuple[list[str], list[str], dict[str, str], list[str]]:
    """(sorted subfolders, sorted file names, skipped entries, names of file links) of one
    folder, hidden ones and symlinked folders left out and reported as skipped.  Subfolders
    share their parent's path, so sorting them as strings sorts them by name, and a
    depth-first walk that takes them in this order visits the tree in path order without
    sorting it whole."""
    folders, names, skipped, links = [], [], {}, []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    skipped[entry.path] = HIDDEN
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
                    elif entry.is_file():
                        names.append(entry.name)
                        if entry.is_symlink():
                            links.append(entry.name)
                    elif entry.is_symlink() and not os.path.exists(entry.path):
                        skipped[entry.path] = f"a dangling link to {os.readlink(entry.path)}"
                    elif entry.is_symlink() and entry.is_dir():
                        target = os.readlink(entry.path)
                        skipped[entry.path] = (
                            f"a link to a folder ({target}), not followed: links could form a "
                            "cycle; point the raw folder at the data itself"
                        )
                except OSError as exc:  # a symlink loop, an entry that vanished or refuses
                    skipped[entry.path] = exc.strerror or str(exc)
    except FileNotFoundError:
        pass  # removed while walking
    except OSError as exc:  # not permitted to list it, or not a folder any more
        skipped[folder] = f"cannot list the folder: {exc.strerror or exc}"
    folders.sort()
    names.sort()
    return folders, names, skipped, links


def _key(name: str, path: Path, root: Path) -> str:
    """``sanitise_key(name)``, or a digest of ``path`` relative to the raw ``root`` when the
    name has no usable character (``扫描.nii.gz``): such a file still gets a partition rather
    than vanishing.  Relative, so that the key, like a name's, survives the root being
    mounted or moved elsewhere (a digest of the absolute path gave the same scan a second
    key, and the manifest a duplicate); not a digest of the content, which discovery never
    reads and which would re-key the item on every edit."""
    try:
        return sanitise_key(name)
    except InvalidKeyError:
        relative = path.relative_to(root).as_posix()
        return "item-" + hashlib.sha1(relative.encode()).hexdigest()[:12]


def _folder_key(folder: Path, base: Path, root: Path) -> str:
    """The key of a folder item: its path under ``base`` (inside ``root``)."""
    parts = folder.relative_to(base).parts or (folder.name,)
    return _key("_".join(parts), folder, root)


def _spike_roots(tree: dict[Path, list[str]]) -> list[Path]:
    return [folder for folder, names in tree.items() if SPIKE_CONFIG in names]


def _under(folder: Path, roots: list[Path]) -> Path | None:
    """The deepest of ``roots`` that holds ``folder``."""
    inside = [r for r in roots if folder.is_relative_to(r)]
    return max(inside, key=lambda r: len(r.parts)) if inside else None


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
    base = _folder_key(folder, root, root)
    found = []
    for uid, paths in sorted(series.items()):
        key = base if len(series) == 1 else _key(f"{base}_{uid}", folder, root)
        found.append((key, folder, CTItem(key, "dicom", folder, tuple(paths), uid)))
    for path in broken:
        key = _key(f"{base}_{path.name}", path, root)
        found.append((key, path, CTItem(key, "dicom", path, (path,))))
    return found


def discover_ct(root: str | Path, tree: Tree | None = None) -> Found[CTItem]:
    """Every CT item under ``root``: NIfTI files, ``.npy``/``.npz`` volumes (outside spike
    datasets) and DICOM series; ``tree`` is :func:`walk_tree`'s, when the caller has it."""
    global _FOUND
    root = Path(root)
    tree = walk_tree(root) if tree is None else tree
    spike_roots = _spike_roots(tree)
    found: list[tuple[str, Path, CTItem]] = []
    memo: dict[Path, tuple[list[str], list]] = {}
    for folder, names in tree.items():
        known = _FOUND.get(folder)
        if known is not None and known[0] is names and known[2] == (root, spike_roots):
            memo[folder] = known  # the same listing (walk_tree): the same items
            found += known[1]
            continue
        items = _ct_files(root, folder, names, spike_roots)
        dicom = _dicom_items(root, folder, names)
        if not dicom:  # DICOM folders are grouped anew: a rewritten slice may move series
            memo[folder] = (names, items, (root, spike_roots))
        found += items + dicom
    _FOUND = memo
    return _collect(root, found, tree.skipped)


# Folder → (its names list from walk_tree, its non-DICOM CT items, the root and spike roots
# then: a key without usable characters depends on the root).
_FOUND: dict[Path, tuple[list[str], list, tuple[Path, list[Path]]]] = {}


def _ct_files(root: Path, folder: Path, names: list[str], spike_roots: list[Path]) -> list:
    """The NIfTI and ``.npy``/``.npz`` items of one folder, their suffixes in any case
    (``CT.NII.GZ``); arrays in spike datasets are not CT."""
    found = []
    present = set(names)
    for name in names:
        path, lower = folder / name, name.lower()
        if lower.endswith(CT_SUFFIXES):
            key = _key(ct_stem(path), path, root)
            found.append((key, path, CTItem(key, "nifti", path)))
        elif lower.endswith(ARRAY_SUFFIXES) and _under(folder, spike_roots) is None:
            stem, kind = name[:-4], lower[-3:]
            sidecar = f"{stem}.json"
            files = (path, folder / sidecar) if sidecar in present else ()
            key = _key(stem, path, root)
            found.append((key, path, CTItem(key, kind, path, files)))
    return found


def read_ct_rate_metadata(
    root: str | Path, tree: Tree | None = None, skipped: dict[str, str] | None = None
) -> dict[str, dict[str, str]]:
    """VolumeName stem → CT-RATE metadata row, from every ``*metadata*.csv`` under ``root``
    (found in ``tree``, :func:`walk_tree`'s, when the caller has it).  The CT-RATE tables are
    read as UTF-8, with or without the byte order mark spreadsheet programs write.  A CSV that
    cannot be read raises :class:`InputError`, or, given ``skipped``, is recorded there and
    left out."""
    tree = walk_tree(root) if tree is None else tree
    rows: dict[str, dict[str, str]] = {}
    for folder, names in tree.items():
        for name in names:
            if fnmatch.fnmatchcase(name, "*metadata*.csv"):
                try:
                    rows.update(_metadata_rows(folder / name))
                except (InputError, OSError, UnicodeDecodeError, csv.Error) as exc:
                    if skipped is None:
                        raise
                    skipped[str(folder / name)] = str(exc)
    return rows


_PARSED: dict[Path, tuple[tuple[int, int], dict[str, dict[str, str]]]] = {}


def _metadata_rows(csv_path: Path) -> dict[str, dict[str, str]]:
    """The rows of one metadata CSV, parsed again only when its size or mtime changed: a
    discovery sensor's code server reads the same 50,000-row CSV on every tick."""
    st = csv_path.stat()
    stamp = (st.st_size, st.st_mtime_ns)
    if csv_path in _PARSED and _PARSED[csv_path][0] == stamp:
        return _PARSED[csv_path][1]
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
    _PARSED[csv_path] = (stamp, rows)
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


@dataclass(frozen=True)
class SpikeSequence:
    """One spike sequence folder and the facts its dataset's ``dataset.json`` gives."""

    folder: Path
    height: int
    width: int
    spike_folder: str
    layout: str
    frames: int

    def modalities(self) -> tuple[tuple[str, str], ...]:
        """(folder, suffix) of each file a sample has: its spikes, blurred and sharp frame."""
        return ((self.spike_folder, ".dat"), ("blur", ".png"), ("sharp", ".png"))

    def members(self) -> dict[str, list[Path]]:
        """Sample stem → its files, one per modality folder where present.  Only files with
        the modality's suffix are members: a stray ``notes.txt`` is no sample, and no file
        of one; a broken link is no file (discovery reports it)."""
        found: dict[str, list[Path]] = {}
        for sub, suffix in self.modalities():
            folder = self.folder / sub
            for name in _list(str(folder))[1]:  # files as discovery sees them: no broken link
                if name.endswith(suffix):
                    found.setdefault(name[: -len(suffix)], []).append(folder / name)
        return dict(sorted(found.items()))

    def samples(self) -> list[str]:
        """Every sample stem, sorted; :class:`InputError` naming each missing file when a
        sample lacks one of its modalities (a sequence never builds with fewer samples)."""
        members = self.members()
        want = len(self.modalities())
        missing = [
            f"{sub}/{stem}{suffix}"
            for stem, files in members.items()
            if len(files) < want
            for sub, suffix in self.modalities()
            if self.folder / sub / f"{stem}{suffix}" not in files
        ]
        if missing:
            raise InputError(
                self.folder,
                f"every sample in {self.spike_folder}/, blur/ and sharp/",
                f"{len(missing)} missing: " + ", ".join(missing[:20]),
            )
        return list(members)

    def files(self) -> list[Path]:
        """The member files (what is hashed and watched), sorted."""
        return sorted(p for files in self.members().values() for p in files)


def _spike_config(path: Path) -> dict:
    try:
        facts = json.loads(path.read_text())
        height, width = int(facts["height"]), int(facts["width"])
        if min(height, width) < 1:
            raise ValueError("height and width must be at least 1")
        for folder, entry in facts["layouts"].items():
            layout, frames = entry["layout"], int(entry["frames"])
            if layout not in ("packed", "bytes"):
                raise ValueError(f"{folder}: layout {layout!r}, expected 'packed' or 'bytes'")
            if frames < 1:
                raise ValueError(f"{folder}: frames must be at least 1, got {frames}")
            if layout == "packed" and height * width % 8:
                raise ValueError(
                    f"{folder}: packed {height}×{width} frames need H·W divisible by 8"
                )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(
            path,
            'JSON with "height", "width" and "layouts": {folder: {"layout", "frames"}}',
            f"{type(exc).__name__}: {exc}",
        ) from exc
    return facts


def discover_spike_sequences(root: str | Path) -> Found[SpikeSequence]:
    """Every sequence of every spike dataset under ``root``.

    A spike dataset is a folder with a ``dataset.json`` (height, width, per-folder layout and
    frame count, as the sample generator and SpikeZoo's configs give them); its sequences are
    the folders below it holding a ``spike_packed/`` or ``spike/`` folder (the first one its
    config lists, in that order).  The key is the path from the dataset folder
    (``train_GOPR0372_07_00``), and a sequence belongs to its nearest dataset folder.
    """
    root = Path(root)
    tree = walk_tree(root)
    spike_roots = _spike_roots(tree)
    skipped, configs = dict(tree.skipped), {}
    for r in spike_roots:
        try:
            configs[r] = _spike_config(r / SPIKE_CONFIG)
        except (InputError, OSError, UnicodeDecodeError) as exc:  # its sequences are left out
            skipped[str(r / SPIKE_CONFIG)] = str(exc)
    chosen: dict[Path, str] = {}
    rank = SPIKE_FOLDERS.index
    for folder in tree:
        parent, dataset = folder.parent, _under(folder.parent, spike_roots)
        if folder.name not in SPIKE_FOLDERS or dataset not in configs:
            continue
        if folder.name in configs[dataset]["layouts"] and (
            parent not in chosen or rank(folder.name) < rank(chosen[parent])
        ):
            chosen[parent] = folder.name
    found = []
    for parent, sub in sorted(chosen.items()):
        dataset = _under(parent, spike_roots)
        facts = configs[dataset]
        layout = facts["layouts"][sub]
        sequence = SpikeSequence(parent, int(facts["height"]), int(facts["width"]), sub,
                                 layout["layout"], int(layout["frames"]))  # fmt: skip
        found.append((_folder_key(parent, dataset, root), parent, sequence))
    return _collect(root, found, skipped)


def discover_image_sets(root: str | Path) -> Found[Path]:
    """Every folder holding images directly, keyed by its path under ``root``
    (``inspection_train``).  Folders inside a spike dataset (its ``blur/`` and ``sharp/``
    frames) belong to that family and are left out."""
    root = Path(root)
    tree = walk_tree(root)
    spike_roots = _spike_roots(tree)
    return _collect(
        root,
        (
            (_folder_key(folder, root, root), folder, folder)
            for folder, names in tree.items()
            if any(n.lower().endswith(IMAGE_SUFFIXES) for n in names)
            and _under(folder, spike_roots) is None
        ),
        tree.skipped,
    )


def image_files(folder: Path, root: Path | None = None) -> list[Path]:
    """The images of a set, as discovery lists them (a broken link is no image, nor, given
    the raw ``root``, a link it refuses: :func:`refused_link`)."""
    names = [n for n in _list(str(folder))[1] if n.lower().endswith(IMAGE_SUFFIXES)]
    return [folder / n for n in names if root is None or refused_link(folder / n, root) is None]
