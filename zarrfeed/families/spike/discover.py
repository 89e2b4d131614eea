"""Finding spike sequences under a raw folder, and their catalog entries.

A spike dataset is a folder with a ``dataset.json`` (height, width, per-folder layout and
frame count, as the sample generator and SpikeZoo's configs give them); its sequences are
the folders below it holding a ``spike_packed/`` or ``spike/`` folder.  The dataset folder
and everything under it belong to this family (:func:`spike_datasets`): other families'
discovery does not see them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from zarrfeed.errors import InputError
from zarrfeed.formats.walk import (
    Found,
    Tree,
    collect,
    file_names,
    folder_key,
    marked,
    under,
    walk_tree,
)
from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import Scan, catalog_entries, raw_origin

SPIKE_FOLDERS = ("spike_packed", "spike")  # preferred first: the camera's own packed stream
SPIKE_CONFIG = "dataset.json"


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
            for name in file_names(folder):  # as discovery sees them: no broken link
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


def spike_datasets(tree: Tree) -> list[Path]:
    """The spike dataset folders of ``tree`` (each holds a ``dataset.json``): this family
    claims them and everything under them, its ``blur/`` and ``sharp/`` frames included."""
    return marked(tree, SPIKE_CONFIG)


def discover_spike_sequences(root: str | Path, tree: Tree | None = None) -> Found[SpikeSequence]:
    """Every sequence of every spike dataset under ``root``.

    A spike dataset is a folder with a ``dataset.json`` (height, width, per-folder layout and
    frame count, as the sample generator and SpikeZoo's configs give them); its sequences are
    the folders below it holding a ``spike_packed/`` or ``spike/`` folder (the first one its
    config lists, in that order).  The key is the path from the dataset folder
    (``train_GOPR0372_07_00``), and a sequence belongs to its nearest dataset folder.
    """
    root = Path(root)
    tree = walk_tree(root) if tree is None else tree
    spike_roots = spike_datasets(tree)
    skipped, configs = dict(tree.skipped), {}
    for r in spike_roots:
        try:
            configs[r] = _spike_config(r / SPIKE_CONFIG)
        except (InputError, OSError, UnicodeDecodeError) as exc:  # its sequences are left out
            skipped[str(r / SPIKE_CONFIG)] = str(exc)
    chosen: dict[Path, str] = {}
    rank = SPIKE_FOLDERS.index
    for folder in tree:
        parent, dataset = folder.parent, under(folder.parent, spike_roots)
        if folder.name not in SPIKE_FOLDERS or dataset not in configs:
            continue
        if folder.name in configs[dataset]["layouts"] and (
            parent not in chosen or rank(folder.name) < rank(chosen[parent])
        ):
            chosen[parent] = folder.name
    found = []
    for parent, sub in sorted(chosen.items()):
        dataset = under(parent, spike_roots)
        facts = configs[dataset]
        layout = facts["layouts"][sub]
        sequence = SpikeSequence(parent, int(facts["height"]), int(facts["width"]), sub,
                                 layout["layout"], int(layout["frames"]))  # fmt: skip
        found.append((folder_key(parent, dataset, root), parent, sequence))
    return collect(root, found, skipped)


def scan_spike(root: str | Path, tree: Tree | None = None) -> Scan:
    """Key → catalog entry for every spike sequence under ``root`` (found in ``tree`` when
    given)."""
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

    found = discover_spike_sequences(root, tree)
    return catalog_entries(found, origin, make, lambda s: s.files())


def spike_sequence(item: RawItem) -> SpikeSequence:
    """The sequence of a catalog entry, from the facts it carries."""
    d = item.evidence
    return SpikeSequence(
        Path(item.location), d["height"], d["width"], d["spike_folder"], d["layout"], d["frames"]
    )
