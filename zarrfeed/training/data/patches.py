"""Where a patch is cut from its volume: one small class per rule, like TorchIO's samplers.

A dataset keeps its index (which volume each sample reads, and so how many patches each
volume gives per epoch); a patch sampler only places the patch inside that volume.  Every
placement is a function of (seed, epoch, index), so a run is repeatable and a resumed run
reads the same patches.  ``StoredPatches`` reads the ``ct_patches`` index (mostly-body
patches chosen when the store was built); ``UniformPatches`` puts the patch anywhere inside
the volume, each position equally likely; ``ForegroundPatches`` centres it on a random
occupied cell of the stored occupancy the dataset names (``occupancy``: the asset of its
window's voxels above the window threshold, ``ct_sparse`` for CT) — TorchIO's
``LabelSampler``/``WeightedSampler`` with that occupancy as the probability map.  What a
sampler provides, and what it reads of its dataset, are the protocols
:class:`~zarrfeed.training.data.protocols.PatchSampling` and
:class:`~zarrfeed.training.data.protocols.PatchSource`: a dataset takes any object that
provides the first.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from zarrfeed.errors import StoreError
from zarrfeed.training.data.protocols import PatchSampling, PatchSource

PATCH_STREAM = 2  # the dataset rng stream that places patches


class PatchSampler:
    """The shared part of the samplers here (a :class:`PatchSampling`): ``name`` as given in
    the config, the check that every volume fits the patch, and placement one sample at a
    time (``origin``) or anywhere in the volume (``uniform``)."""

    name = ""
    whole_volume = True  # a sample may read anywhere in its volume (the block sampler's units)

    def bind(self, dataset: PatchSource) -> None:
        self.dataset = dataset
        small = [
            dataset.keys[i]
            for i in np.unique(dataset.items).tolist()
            if np.any(np.asarray(self.volume_shape(i)) < dataset.patch_shape)
        ]
        if small:
            raise StoreError(
                f"{dataset.asset} of {dataset.url}: volumes {small} are smaller than the "
                f"patch {dataset.patch_shape}: no {self.name} patch fits them"
            )

    def volume_shape(self, item: int) -> tuple[int, ...]:
        return self.dataset.shape_of(item, self.dataset.window)

    def origins(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), ndim) int64 origins of those samples' patches this epoch."""
        return np.array([self.origin(int(i)) for i in indices], np.int64).reshape(
            len(indices), len(self.dataset.patch_shape)
        )

    def origin(self, index: int) -> np.ndarray:
        raise NotImplementedError

    def uniform(self, index: int, rng: np.random.Generator) -> np.ndarray:
        """An origin anywhere in sample ``index``'s volume, each equally likely."""
        shape = np.asarray(self.volume_shape(int(self.dataset.items[index])))
        return rng.integers(0, shape - np.asarray(self.dataset.patch_shape) + 1)


class StoredPatches(PatchSampler):
    """The stored patch index's origin for each sample (mostly-body patches)."""

    name, whole_volume = "stored", False

    def bind(self, dataset: PatchSource) -> None:
        self.dataset = dataset  # the index only holds patches that fit

    def origins(self, indices: np.ndarray) -> np.ndarray:
        return self.dataset.origins[indices].astype(np.int64)


class UniformPatches(PatchSampler):
    """Anywhere inside the volume, every position equally likely (TorchIO's
    ``UniformSampler``): air and body as they come."""

    name = "uniform"

    def origin(self, index: int) -> np.ndarray:
        return self.uniform(index, self.dataset.rng(index, PATCH_STREAM))


class ForegroundPatches(PatchSampler):
    """Centred on a random occupied cell of the stored occupancy (the asset the dataset names
    as ``occupancy``, one array per window), each cell equally likely, with probability
    ``foreground``; anywhere in the volume otherwise (MONAI's positive/negative ratio).
    Patches are clamped inside the volume, so a centre near an edge moves the patch, not its
    size."""

    name = "foreground"

    def __init__(self, foreground: float = 1.0) -> None:
        if not 0.0 <= foreground <= 1.0:
            raise ValueError(f"foreground must be a share in [0, 1], got {foreground}")
        self.foreground = foreground
        self._cells: dict[int, np.ndarray] = {}

    def bind(self, dataset: PatchSource) -> None:
        super().bind(dataset)
        self._cells = {}
        self.occupancy: str = dataset.occupancy
        if self.occupancy not in dataset.manifest_assets:
            raise StoreError(
                f"{dataset.url}: the {dataset.dataset} manifest has no {self.occupancy}: "
                "foreground patches need the stored occupancy"
            )
        self.partitions = dataset.manifest_assets[self.occupancy]["partitions"]
        if dataset.window not in self.partitions[0]["arrays"]:
            have = ", ".join(sorted(self.partitions[0]["arrays"]))
            raise StoreError(
                f"{self.occupancy} of {dataset.url} has no window {dataset.window!r} "
                f"(it has {have}): rebuild {self.occupancy} with that window"
            )
        # The versions the manifest lists, as the windows are read: a partition rebuilt
        # since (another grid, other cells) fails loudly instead of mixing two builds.
        first = dataset.store.open_partition(
            self.occupancy, dataset.keys[0], self.partitions[0]["version"]
        )
        self.grid = int(first.attrs["params"]["sparse_grid"] or 0)  # 0: full resolution

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cells": {}}  # each process reads what it samples

    def cells(self, item: int) -> np.ndarray:
        """The occupied cells of volume ``item`` (read once per process)."""
        found = self._cells.get(item)
        if found is None:
            key, version = self.dataset.keys[item], self.partitions[item]["version"]
            found = self.dataset.store.read_array(self.occupancy, key, self.dataset.window, version)
            if not len(found):
                raise StoreError(
                    f"{self.occupancy}/{key} of {self.dataset.url} has no occupied cell in "
                    f"window {self.dataset.window!r}: nothing to centre foreground patches on "
                    "(use patch_sampler='uniform')"
                )
            self._cells[item] = found
        return found

    def origin(self, index: int) -> np.ndarray:
        rng = self.dataset.rng(index, PATCH_STREAM)
        if rng.random() >= self.foreground:
            return self.uniform(index, rng)
        item = int(self.dataset.items[index])
        cells = self.cells(item)
        cell = cells[rng.integers(len(cells))].astype(np.int64)
        shape = np.asarray(self.volume_shape(item), np.int64)
        grid = shape if not self.grid else np.full(len(shape), self.grid, np.int64)
        # Cell c of g over n voxels holds voxels [ceil(c n / g), ceil((c + 1) n / g)); an
        # axis shorter than the grid puts voxel v in cell v g // n (one voxel per used cell).
        lo = -(-cell * shape // grid)
        hi = np.maximum(lo + 1, -(-(cell + 1) * shape // grid))
        centre = lo + (rng.random(len(shape)) * (hi - lo)).astype(np.int64)
        patch = np.asarray(self.dataset.patch_shape, np.int64)
        return np.clip(centre - patch // 2, 0, shape - patch)


PATCH_SAMPLERS: dict[str, type[PatchSampler]] = {
    s.name: s for s in (StoredPatches, UniformPatches, ForegroundPatches)
}


def make_patch_sampler(spec: str | PatchSampling) -> PatchSampling:
    """A sampler from its name ("stored", "uniform", "foreground"), or a copy of a sampler."""
    if isinstance(spec, str):
        if spec not in PATCH_SAMPLERS:
            raise ValueError(f"patch_sampler must be one of {sorted(PATCH_SAMPLERS)}, got {spec!r}")
        return PATCH_SAMPLERS[spec]()
    if not isinstance(spec, PatchSampling):
        raise TypeError(
            f"patch_sampler must be one of {sorted(PATCH_SAMPLERS)} or a PatchSampling "
            f"(whole_volume, bind, origins), got {spec!r}"
        )
    return copy.copy(spec)  # binding it to a dataset leaves the caller's object as it was
