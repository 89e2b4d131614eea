"""Raw items of every source as catalog entries, and what a build checks of them.

A family's discovery (``zarrfeed.families.<family>``) finds its items in a walk of the raw
folder (``zarrfeed.formats.walk``); :func:`catalog_entries` stamps every item with its size
and modification time (a DICOM series or a sequence folder: the sum of its files' sizes and
the newest mtime), without reading any file.  Hub volumes are items too (``hf://``
locations, the LFS hash as their content hash), so every source of a family feeds the same
partitions and the same graph.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zarrfeed.errors import InputError
from zarrfeed.formats.walk import Found, link_target, refused_link
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


def catalog_entries(
    found: Found,
    origin: str,
    make: Callable[[str, Any, int, float], RawItem],
    files: Callable[[Any], list[Path]],
) -> Scan:
    """Catalog entries of ``found``, each ``make(key, item, size, mtime)`` of the ``files``
    it reads; a collided key is one entry naming every location.  An
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


def item_root(item: RawItem) -> Path | None:
    """The raw folder a local item was discovered in (None for a hub item)."""
    return Path(item.origin.removeprefix("raw:")) if item.origin.startswith("raw:") else None


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
