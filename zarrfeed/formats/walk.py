"""Walking a raw folder, for every family's discovery: listings, keys, links, collisions.

One ``os.scandir`` recursion lists the tree (:func:`walk_tree`); the families' finders
classify what it lists.  Every entry the walk leaves out is listed with the reason: a hidden
one (a name starting with ``.``, ``..dots.nii.gz`` too, by Unix convention) and, under
``ZARRFEED_RAW_LINKS=inside`` (:func:`links_policy`), a file link whose target lies outside
the raw folder.  Other file links are followed: the item is read at the target, and its
provenance records both.

Discovery survives any single broken entry: a symlink loop, a dangling link, a folder it may
not list is skipped and reported with its path and the reason (``Tree.skipped``,
``Found.skipped``); every other item is still found.

Every finder returns a :class:`Found`: partition key → item, plus the collisions, keys that
two or more raw items sanitise to (``x y.nii.gz`` and ``x_y.nii.gz``).  A collision neither
fails the whole discovery nor drops one item silently: its partition fails alone, naming
every file (:meth:`Found.get`), and every other item builds.

Keys are ``[A-Za-z0-9._-]`` (:func:`zarrfeed.store.keys.sanitise_key`); a name with no
usable character gets ``item-`` and a digest of its path under the root (:func:`item_key`),
so no key depends on where the root is mounted.

Nothing here keeps state between calls: what a walk may reuse from an earlier one is a
:class:`TreeCache` its caller holds and passes in (a discovery sensor, tick after tick).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

from zarrfeed import defaults
from zarrfeed.errors import InputError, InvalidKeyError
from zarrfeed.store.keys import sanitise_key

HIDDEN = "hidden (its name starts with '.'): left out by convention; rename it to build it"
LINK_POLICIES = ("follow", "inside")
SETTLED_NS = 2_000_000_000  # a folder changed less than this ago may change again unseen
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


def collect(root: Path, found: Iterable[tuple[str, Path, T]], skipped: dict[str, str]) -> Found[T]:
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


class TreeCache:
    """What earlier walks saw, for a caller that walks the same tree again and again (a
    discovery sensor walks 50,000 files every tick): each folder's listing, and what
    finders derived from it (:attr:`derived`, finder name → its own memo, which the finder
    replaces on every walk so that folders gone are forgotten).  ``settled_ns``: a folder
    changed less than this long ago is listed again, its mtime too fresh to trust."""

    def __init__(self, settled_ns: int = SETTLED_NS) -> None:
        self.settled_ns = settled_ns
        self.listings: dict[str, _Listing] = {}
        self.derived: dict[str, Any] = {}


class Tree(dict):
    """:func:`walk_tree`'s result: folder → sorted file names, in path order; ``skipped``:
    every broken entry met (path → why), so finders can report them; ``cache``: the
    :class:`TreeCache` the walk used, where finders keep what they derive."""

    skipped: dict[str, str]
    cache: TreeCache

    def without(self, roots: Sequence[Path]) -> Tree:
        """This tree less every folder at or under one of ``roots`` (the folders another
        family claims): the same name lists, the same skipped entries and cache."""
        if not roots:
            return self
        kept = Tree((f, n) for f, n in self.items() if under(f, roots) is None)
        kept.skipped, kept.cache = self.skipped, self.cache
        return kept


def walk_tree(root: str | Path, cache: TreeCache | None = None) -> Tree:
    """Folder → sorted file names of every folder under ``root``, in path order.  Hidden
    entries are skipped, and symlinked folders are not followed (no cycles); a missing root
    is an empty tree.  Broken entries (a symlink loop, a dangling link, a folder that cannot
    be listed) and symlinked folders are left out and listed in the result's ``skipped``.

    Given the ``cache`` of an earlier walk, a folder whose mtime (which changes when an
    entry is added, removed or renamed) is what that walk saw is not listed again — one
    ``stat`` instead of a scan — unless it changed too recently for its mtime to be trusted
    or held broken entries; its names come back as the very same list, so finders may reuse
    what they derived from it.  Paths stay strings until the end: pathlib's parsing and
    comparisons cost more than the scan at this size.
    """
    cache = TreeCache() if cache is None else cache
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
        listing = cache.listings.get(folder)
        # A folder with broken entries is listed again: a dangling link mends (its target
        # appears, a mount comes back) without changing the folder's mtime.
        if (
            listing is None
            or listing.mtime != mtime
            or any(why != HIDDEN for why in listing.skipped.values())
            or now - mtime <= cache.settled_ns
        ):
            listing = _Listing(mtime, *_list(folder), Path(folder))
        seen[folder] = listing
        skipped.update(listing.skipped)
        stack.extend(reversed(listing.folders))  # sorted: popped smallest first
    cache.listings = seen  # folders gone since are forgotten
    names = {folder: _followed(listing, root, skipped) for folder, listing in seen.items()}
    tree = Tree((listing.path, names[f]) for f, listing in seen.items())  # in path order
    tree.skipped, tree.cache = skipped, cache
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


def file_names(folder: str | Path) -> list[str]:
    """The sorted file names of one folder as the walk sees them: no hidden entry, no
    broken link."""
    return _list(os.fspath(folder))[1]


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


def item_key(name: str, path: Path, root: Path) -> str:
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


def folder_key(folder: Path, base: Path, root: Path) -> str:
    """The key of a folder item: its path under ``base`` (inside ``root``)."""
    parts = folder.relative_to(base).parts or (folder.name,)
    return item_key("_".join(parts), folder, root)


def marked(tree: dict[Path, list[str]], marker: str) -> list[Path]:
    """The folders of ``tree`` that hold a file named ``marker`` (``dataset.json``)."""
    return [folder for folder, names in tree.items() if marker in names]


def under(folder: Path, roots: Sequence[Path]) -> Path | None:
    """The deepest of ``roots`` that holds ``folder`` (or is it)."""
    inside = [r for r in roots if folder.is_relative_to(r)]
    return max(inside, key=lambda r: len(r.parts)) if inside else None
