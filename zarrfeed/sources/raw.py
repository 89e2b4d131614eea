"""Raw items of every source as catalog entries, and back to what their readers take.

A raw folder is scanned by the ``zarrfeed.formats.discover`` finders (one tree walk each)
and every item is stamped with its size and modification time (a DICOM series or a sequence
folder: the sum of its files' sizes and the newest mtime), without reading any file.  A CT
item carries its CT-RATE metadata row's rescale as evidence, so an edited CSV makes exactly
its scans change.  Hub volumes are items too (``hf://`` locations, the LFS hash as their
content hash), so every CT source feeds the same partitions and the same graph.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zarrfeed.errors import InputError
from zarrfeed.formats.ct import CTItem
from zarrfeed.formats.discover import (
    Found,
    SpikeSequence,
    discover_ct,
    discover_image_sets,
    discover_spike_sequences,
    image_files,
    link_target,
    read_ct_rate_metadata,
    refused_link,
    walk_tree,
)
from zarrfeed.sources.catalog import RawItem
from zarrfeed.store.provenance import file_sha256
from zarrfeed.transforms.hu import csv_rescale

if TYPE_CHECKING:
    from zarrfeed.sources.hub import CTRateHub, HubVolume

HF_PREFIX = "hf://datasets/"


def raw_origin(root: str | Path) -> str:
    return f"raw:{os.path.abspath(root)}"


def _stat(paths: Iterable[Path]) -> tuple[int, float]:
    size, mtime = 0, 0.0
    for p in paths:
        st = os.stat(p)
        size, mtime = size + st.st_size, max(mtime, st.st_mtime)
    return size, mtime


class Scan(dict):
    """Key → catalog entry of every raw item found, and ``skipped``: the broken entries
    discovery left out (path → why), for the sensor's log and ``zarrfeed status``."""

    skipped: dict[str, str]


def _items(found: Found, origin: str, make: callable, files: callable) -> Scan:
    """Catalog entries of ``found``; a collided key is one entry naming every location.  An
    item whose files cannot be stat'ed (gone since the walk, unreachable) is skipped, and so
    is one whose evidence cannot be read (a metadata row with a malformed rescale): one bad
    item never stops the discovery of the others."""
    out = Scan()
    out.skipped = dict(found.skipped)
    for key, thing in found.items.items():
        paths = []
        try:
            paths = files(thing)
            out[key] = make(key, thing, *_stat(paths))
        except OSError as exc:
            out.skipped[str(exc.filename or key)] = exc.strerror or str(exc)
        except InputError as exc:
            out.skipped[str(paths[0]) if paths else key] = str(exc)
    for key, paths in found.collisions.items():
        first, *others = paths
        out[key] = RawItem(
            key, "conflict", str(first), origin, 0, 0.0, conflict=tuple(str(p) for p in others)
        )
    return out


def scan_ct(root: str | Path, metadata: Mapping[str, Mapping[str, str]] | None = None) -> Scan:
    """Key → catalog entry for every CT item under ``root`` (NIfTI, DICOM series,
    ``.npy``/``.npz`` volumes); ``metadata`` defaults to the CT-RATE CSVs found there."""
    origin = raw_origin(root)
    tree = walk_tree(root)  # one walk finds the volumes and the CSVs
    rows = read_ct_rate_metadata(root, tree, tree.skipped) if metadata is None else metadata

    def make(key: str, item: CTItem, size: int, mtime: float) -> RawItem:
        claim = csv_rescale(rows.get(key))
        evidence = {"csv": [claim.slope, claim.intercept]} if claim else {}
        detail = {"files": [str(p) for p in item.files], "series_uid": item.series_uid}
        return RawItem(key, item.kind, str(item.path), origin, size, mtime, evidence, detail)

    return _items(discover_ct(root, tree), origin, make, lambda item: item.sources())


def ct_item(item: RawItem, local: Path | None = None) -> CTItem:
    """What :func:`zarrfeed.formats.ct.read_ct` reads for a CT entry; ``local`` is where a
    hub volume was downloaded to."""
    if is_hub(item):
        if local is None:
            raise ValueError(f"{item.location}: download the hub volume first")
        return CTItem(item.key, "nifti", local)
    files = tuple(Path(p) for p in item.detail.get("files", ()))
    return CTItem(item.key, item.kind, Path(item.location), files, item.detail.get("series_uid"))


def scan_spike(root: str | Path) -> Scan:
    """Key → catalog entry for every spike sequence under ``root``."""
    origin = raw_origin(root)

    def make(key: str, seq: SpikeSequence, size: int, mtime: float) -> RawItem:
        # The dataset's dataset.json lies outside the sequence folder: its facts are evidence,
        # so editing it changes the item (and its partitions' fingerprints).
        facts = {
            "height": seq.height,
            "width": seq.width,
            "spike_folder": seq.spike_folder,
            "layout": seq.layout,
            "frames": seq.frames,
        }
        return RawItem(key, "spike", str(seq.folder), origin, size, mtime, evidence=facts)

    return _items(discover_spike_sequences(root), origin, make, lambda s: s.files())


def spike_sequence(item: RawItem) -> SpikeSequence:
    d = item.evidence
    return SpikeSequence(
        Path(item.location), d["height"], d["width"], d["spike_folder"], d["layout"], d["frames"]
    )


def scan_images(root: str | Path) -> Scan:
    """Key → catalog entry for every image set (a folder of images) under ``root``."""
    origin = raw_origin(root)

    def make(key: str, folder: Path, size: int, mtime: float) -> RawItem:
        return RawItem(key, "images", str(folder), origin, size, mtime)

    return _items(discover_image_sets(root), origin, make, lambda f: image_files(f, Path(root)))


def item_root(item: RawItem) -> Path | None:
    """The raw folder a local item was discovered in (None for a hub item)."""
    return Path(item.origin.removeprefix("raw:")) if item.origin.startswith("raw:") else None


def item_files(item: RawItem) -> list[Path]:
    """An image set's files as discovery lists them under the item's raw folder."""
    return image_files(Path(item.location), item_root(item))


def source_links(item: RawItem, files: list[Path]) -> dict[str, dict[str, Any]]:
    """Link → its resolved target, whether that lies inside the raw folder, and the
    target's sha256, for the item's location and each of its ``files`` that is a symlink:
    what a partition read is recorded, not only the link's name.  A link the raw folder's
    policy refuses (``ZARRFEED_RAW_LINKS=inside``, :func:`refused_link`) fails naming it."""
    root = item_root(item)
    if root is None:
        return {}
    out = {}
    for path in dict.fromkeys([Path(item.location), *files]):
        found = link_target(path, root)
        if found is None:
            continue
        why = refused_link(path, root)
        if why is not None:
            raise InputError(path, "a file inside the raw folder, or a link it follows", why)
        target, inside = found
        sha = file_sha256(target) if os.path.isfile(target) else None
        out[str(path)] = {"target": target, "inside_root": inside, "sha256": sha}
    return out


def hub_origin(hub: CTRateHub) -> str:
    return f"hub:{hub.repo_id}:{hub.split}"


def hub_items(
    hub: CTRateHub,
    commit: str,
    volumes: Mapping[str, HubVolume],
    metadata: Mapping[str, Mapping[str, str]],
) -> dict[str, RawItem]:
    """Catalog entries of hub volumes listed at ``commit``: the LFS sha256 is their content
    hash, and the commit pins the bytes, so the stamp changes only with the listing."""
    origin = hub_origin(hub)
    out = {}
    for key, v in volumes.items():
        claim = csv_rescale(metadata.get(key))
        evidence = {"csv": [claim.slope, claim.intercept]} if claim else {}
        location = f"{HF_PREFIX}{hub.repo_id}@{commit}/{v.path}"
        item = RawItem(
            key,
            "nifti",
            location,
            origin,
            v.size,
            0.0,
            evidence,
            {"repo": hub.repo_id, "commit": commit, "path": v.path},
            conflict=tuple(f"{HF_PREFIX}{hub.repo_id}@{commit}/{path}" for path in v.conflict),
        )
        out[key] = RawItem(
            **{
                **item.__dict__,
                "sha256": v.sha256,
                "hashed_stamp": item.stamp if v.sha256 else None,
            }
        )
    return out


def is_hub(item: RawItem) -> bool:
    return item.location.startswith(HF_PREFIX)


def missing_source(item: RawItem) -> str | None:
    """What is gone of a local item's source, or None when it is there (or on the hub): the
    whole raw folder it was discovered in when that is gone, else its own file or folder.
    One stat each, no file read, so a status over 50,000 items stays cheap."""
    if is_hub(item) or os.path.exists(item.location):
        return None
    folder = item.origin.removeprefix("raw:")
    if item.origin.startswith("raw:") and not os.path.isdir(folder):
        return f"the raw folder {folder} is missing"
    return f"{item.location} is missing"


class SourceWatch:
    """The files a local raw item reads, as they were when a build began.

    A build reads its files one by one over seconds or minutes; a file deleted, rewritten or
    replaced meanwhile would leave a partition made of two versions of the source, or of
    fewer samples.  :meth:`verify` after reading fails the partition naming the file instead
    (size, mtime in nanoseconds and inode: a rewrite or an atomic replacement both show).
    Hub items are pinned by their commit and never change.  ``files``: every local file the
    item reads (its family's ``RawSource.files``).
    """

    def __init__(self, item: RawItem, files: list[Path]) -> None:
        self.location = item.location
        files = [] if is_hub(item) else files
        # An item that is a folder (a series, a sequence, an image set) also changes when a
        # member is added: its member folders' mtimes say so.
        folders = sorted({p.parent for p in files}) if os.path.isdir(item.location) else []
        self.before = {p: self._signature(p) for p in [*files, *folders]}

    def _signature(self, path: Path) -> tuple[int, int, int] | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns, st.st_ino

    def verify(self) -> None:
        """:class:`InputError` naming the first file that vanished or changed since."""
        for path, before in self.before.items():
            now = self._signature(path)
            if now != before:
                found = "vanished" if now is None else "changed"
                raise InputError(
                    path, f"the file as it was when the build of {self.location} began",
                    f"it {found} during the build (the next discovery builds it again)",
                )  # fmt: skip


def item_sha256(item: RawItem, files: list[Path]) -> str:
    """The content hash of a local raw item that reads ``files``: of its file when the item
    is that file, else over the names and hashes of its files (a DICOM series, a sequence or
    an image folder)."""
    if [Path(item.location)] == files:
        return file_sha256(files[0])
    h = hashlib.sha256()
    base = Path(item.location)
    for path in files:
        name = path.relative_to(base) if path.is_relative_to(base) else path.name
        h.update(f"{name}\0{file_sha256(path)}\n".encode())
    return h.hexdigest()


def source_identity(item: RawItem, sha256: str) -> dict[str, Any]:
    """What a first-stage partition's content depends on from its raw item: the bytes and
    the evidence beside them (the CSV's rescale)."""
    return {"sha256": sha256, "evidence": item.evidence}


def source_version(item: RawItem, sha256: str) -> str:
    """The raw asset's data version: a digest of :func:`source_identity`."""
    blob = json.dumps(source_identity(item, sha256), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()
