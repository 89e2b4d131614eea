"""Finding image sets under a raw folder (a folder holding images directly is a set), and
their catalog entries."""

from __future__ import annotations

from pathlib import Path

from zarrfeed.formats.walk import (
    Found,
    Tree,
    collect,
    file_names,
    folder_key,
    refused_link,
    walk_tree,
)
from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import Scan, catalog_entries, item_root, raw_origin

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff")


def discover_image_sets(root: str | Path, tree: Tree | None = None) -> Found[Path]:
    """Every folder holding images directly, keyed by its path under ``root``
    (``inspection_train``), found in ``tree`` when given (less the folders other families
    claim, such as a spike dataset's frames)."""
    root = Path(root)
    tree = walk_tree(root) if tree is None else tree
    return collect(
        root,
        (
            (folder_key(folder, root, root), folder, folder)
            for folder, names in tree.items()
            if any(n.lower().endswith(IMAGE_SUFFIXES) for n in names)
        ),
        tree.skipped,
    )


def image_files(folder: Path, root: Path | None = None) -> list[Path]:
    """The images of a set, as discovery lists them (a broken link is no image, nor, given
    the raw ``root``, a link it refuses: :func:`refused_link`)."""
    names = [n for n in file_names(folder) if n.lower().endswith(IMAGE_SUFFIXES)]
    return [folder / n for n in names if root is None or refused_link(folder / n, root) is None]


def scan_images(root: str | Path, tree: Tree | None = None) -> Scan:
    """Key → catalog entry for every image set (a folder of images) under ``root`` (found in
    ``tree`` when given)."""
    origin = raw_origin(root)

    def make(key: str, folder: Path, size: int, mtime: float) -> RawItem:
        return RawItem(key, "images", str(folder), origin, size, mtime)

    found = discover_image_sets(root, tree)
    return catalog_entries(found, origin, make, lambda f: image_files(f, Path(root)))


def item_files(item: RawItem) -> list[Path]:
    """An image set's files as discovery lists them under the item's raw folder."""
    return image_files(Path(item.location), item_root(item))
