"""The data contract: every stored asset declared once.

Each :class:`StoredAsset` says where its partitions live in the store, which arrays they hold
(dims, dtype, how training reads them), its code version, which settings and which inputs make
up a partition's *fingerprint*, and its blocking checks.  Everything else derives from these
declarations: the Dagster asset definitions (keys, deps, code versions, checks,
descriptions), the one build routine that writes every partition, training's readers (store
paths and array names), and the single notion of "out of date" used by reuse, the UI and the
nightly schedules:

    a partition is current when its committed fingerprint equals the fingerprint computed now
    from the asset's code version, the settings it declares, and its inputs (the raw item's
    content hash and evidence for the first stage, the upstream partitions' fingerprints for
    the others).

Settings are plain values here (resources hand them in), so this module imports no Dagster.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zarrfeed.store.codecs import Content, Read

SOURCE = "source"  # the input name of the raw item (its content hash and evidence)


@dataclass(frozen=True)
class ArraySpec:
    """One array of a partition; ``per`` names a list setting with one array per entry
    (CT windows), so the array's name is the entry."""

    name: str
    dims: tuple[str, ...]
    dtype: str | tuple[str, ...]  # one dtype, or those allowed (images keep their depth)
    read: Read = "patch"
    content: Content = "dense"
    per: str | None = None


@dataclass(frozen=True)
class StoredAsset:
    """An asset whose partitions are committed to the store."""

    name: str  # the Dagster asset key
    path: str  # the store path of its partitions
    family: str
    version: str  # bump whenever the builder's output for the same inputs changes
    arrays: tuple[ArraySpec, ...]
    description: str
    params: tuple[str, ...] = ()  # settings that shape every partition
    keyed_params: tuple[str, ...] = ()  # mappings of settings by partition key (overrides)
    inputs: tuple[str, ...] = (SOURCE,)  # SOURCE and/or names of upstream stored assets
    checks: tuple[str, ...] = ()  # blocking: a partition failing one never enters a dataset
    kinds: frozenset[str] = frozenset({"zarr", "numpy"})

    def settings_of(self, settings: Mapping[str, Any], key: str | None = None) -> dict[str, Any]:
        """The declared settings (and, with ``key``, that partition's keyed settings)."""
        missing = [p for p in (*self.params, *self.keyed_params) if p not in settings]
        if missing:
            raise KeyError(f"{self.name}: settings lack {missing}")
        out = {p: _plain(settings[p]) for p in self.params}
        if key is not None:
            out |= {p: _plain((settings[p] or {}).get(key)) for p in self.keyed_params}
        return out

    def code_version(self, settings: Mapping[str, Any]) -> str:
        """The code version Dagster sees: the builder's version and a hash of the settings,
        so a changed setting makes exactly the assets that declare it stale in the UI."""
        if not self.params:
            return self.version
        return f"{self.version}.{_digest(self.settings_of(settings))[:8]}"

    def fingerprint(self, settings: Mapping[str, Any], key: str, inputs: Mapping[str, Any]) -> str:
        """A hash of everything partition ``key``'s content depends on."""
        missing = [i for i in self.inputs if i not in inputs]
        if missing:
            raise KeyError(f"{self.name}[{key}]: inputs lack {missing}")
        wanted = {i: inputs[i] for i in self.inputs}
        return _digest([self.version, self.settings_of(settings, key), wanted])[:32]

    def array_names(self, settings: Mapping[str, Any]) -> list[str]:
        names: list[str] = []
        for spec in self.arrays:
            names.extend(settings[spec.per] if spec.per else [spec.name])
        return names

    def array(self, name: str) -> ArraySpec:
        """The spec of array ``name`` (a window name finds its ``per`` spec)."""
        for spec in self.arrays:
            if spec.name == name or spec.per:
                return spec
        raise KeyError(f"{self.name} declares no array {name!r}")


@dataclass(frozen=True)
class Dataset:
    """What training consumes: the keys complete (and passing every blocking check) in all
    of ``assets``, plus consolidated tables (``datasets/<name>/<table>``)."""

    name: str
    assets: tuple[StoredAsset, ...]
    tables: Mapping[str, tuple[StoredAsset, tuple[str, ...]]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"datasets/{self.name}"


@dataclass(frozen=True)
class Family:
    """A kind of raw item and the stored assets built from it, partition by partition."""

    name: str
    partitions: str  # the dynamic partitions definition's name
    raw_asset: str
    dataset: Dataset

    @property
    def assets(self) -> tuple[StoredAsset, ...]:
        """Its stored assets, each after the ones it reads."""
        return self.dataset.assets

    def expected(
        self, settings: Mapping[str, Any], key: str, source: Mapping[str, Any]
    ) -> dict[str, str]:
        """The fingerprint each stored asset's partition ``key`` should have now, given the
        raw item's identity ``source`` (assets in dependency order)."""
        out: dict[str, str] = {}
        for spec in self.assets:
            inputs = {i: (source if i == SOURCE else out[i]) for i in spec.inputs}
            out[spec.name] = spec.fingerprint(settings, key, inputs)
        return out


def stale_reason(record: Mapping[str, Any] | None, expected: str) -> str | None:
    """Why a partition with commit ``record`` is out of date, or None when it is current.

    The one rule behind reuse, the nightly rebuild and ``zarrfeed status``.  A partition that
    failed its checks is current if nothing changed: building it again would fail again.
    """
    if record is None:
        return "missing"
    if record.get("attrs", {}).get("fingerprint") != expected:
        return "inputs, settings or code changed since the last build"
    return None


def failed_checks(record: Mapping[str, Any] | None) -> list[str]:
    """The blocking checks a committed partition failed (it never enters a dataset)."""
    return sorted(n for n, ok in ((record or {}).get("checks") or {}).items() if not ok)


def _plain(value: Any) -> Any:
    """Settings as JSON-stable values (tuples and lists hash alike)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


# -- the declarations ----------------------------------------------------------------------

ZYX = ("z", "y", "x")

CT_HU = StoredAsset(
    name="ct_hu",
    path="ct/hu",
    family="ct",
    version="3",  # 3: DICOM reoriented to (S, A, R); NIfTI units and method-1 geometry
    arrays=(ArraySpec("hu", ZYX, "int16"),),
    description=(
        "CT volume in Hounsfield units (int16), the rescale decided from all the evidence, "
        "padding turned to air, resampled to the configured spacing, optionally cropped or "
        "padded to a fixed shape, clipped to [-1024, 3071]."
    ),
    params=("spacing_zyx_mm", "crop_pad_zyx"),
    keyed_params=("hu_overrides",),
    checks=("hu_range", "hu_plausible", "matches_source"),
)
CT_WINDOWS = StoredAsset(
    name="ct_windows",
    path="ct/windows",
    family="ct",
    version="1",
    arrays=(ArraySpec("window", ZYX, "float16", per="windows"),),
    description="float16 windowed volumes in [0, 1], one array per configured window, "
    "chunked 64³ for patch reads.",
    params=("windows",),
    inputs=("ct_hu",),
    checks=("window_range",),
)
CT_SPARSE = StoredAsset(
    name="ct_sparse",
    path="ct/sparse",
    family="ct",
    version="1",
    arrays=(ArraySpec("coords", ("point", "axis"), "uint16", read="rows", per="windows"),),
    description="uint16 (N, 3) coordinates of occupied cells per window: a voxel is occupied "
    "where its windowed value exceeds the threshold, on a sparse_grid³ grid (TRELLIS-style) "
    "or at full resolution.",
    params=("windows", "sparse_threshold", "sparse_grid"),
    inputs=("ct_hu",),
    checks=("min_points", "in_bounds"),
)
CT_PATCHES = StoredAsset(
    name="ct_patches",
    path="ct/patches",
    family="ct",
    version="1",
    arrays=(
        ArraySpec("origins", ("patch", "axis"), "uint16", read="rows"),
        ArraySpec("fraction", ("patch",), "float32", read="rows"),
    ),
    description="Origins of the patches that are mostly body, with their body fractions: "
    "training samples patches from this index instead of rejecting air at load time.",
    params=("patch_zyx", "patch_stride_zyx", "body_hu", "min_body_fraction"),
    inputs=("ct_hu",),
    checks=("non_empty", "in_bounds"),
)
SPIKE_VOXELS = StoredAsset(
    name="spike_voxels",
    path="spike/voxels",
    family="spike",
    version="1",
    arrays=(ArraySpec("voxels", ("sample", "bin", "y", "x"), "uint8", "sample", "events"),),
    description="uint8 (samples, bins, H, W) spike counts: each sample's camera frames "
    "summed per bin.",
    params=("bins",),
    checks=("counts_valid",),
)
SPIKE_FRAMES = StoredAsset(
    name="spike_frames",
    path="spike/frames",
    family="spike",
    version="1",
    arrays=(
        ArraySpec("blur", ("sample", "y", "x", "c"), "uint8", "sample"),
        ArraySpec("sharp", ("sample", "y", "x", "c"), "uint8", "sample"),
    ),
    description="uint8 (samples, H, W, 3) blurred and sharp frames, sample-aligned with the "
    "spike voxels.",
    checks=("frames_aligned",),
)
IMAGE_STORE = StoredAsset(
    name="image_store",
    path="images/images",
    family="images",
    version="1",
    arrays=(ArraySpec("images", ("image", "y", "x", "c"), ("uint8", "uint16"), "sample"),),
    description="(N, H, W, C) images of one set, one chunk per image; file names in the "
    "provenance.",
    checks=("uniform_shape",),
)
IMAGE_PATCHES = StoredAsset(
    name="image_patches",
    path="images/patches",
    family="images",
    version="1",
    arrays=(
        ArraySpec("items", ("patch",), "uint32", read="rows"),
        ArraySpec("origins", ("patch", "axis"), "uint16", read="rows"),
        ArraySpec("fraction", ("patch",), "float32", read="rows"),
    ),
    description="Patch origins (image, y, x) whose foreground fraction passes the filter: "
    "training crops first, then processes.",
    params=("patch_yx", "stride_yx", "foreground", "min_foreground_fraction"),
    inputs=("image_store",),
    checks=("non_empty", "in_bounds"),
)

CT_DATASET = Dataset(
    "ct",
    (CT_HU, CT_WINDOWS, CT_SPARSE, CT_PATCHES),
    {"patches": (CT_PATCHES, ("origins", "fraction"))},
)
SPIKE_DATASET = Dataset("spike", (SPIKE_VOXELS, SPIKE_FRAMES))
IMAGE_DATASET = Dataset(
    "image", (IMAGE_STORE, IMAGE_PATCHES), {"patches": (IMAGE_PATCHES, ("items", "origins"))}
)

FAMILIES = {
    f.name: f
    for f in (
        Family("ct", "ct_scans", "ct_raw_scan", CT_DATASET),
        Family("spike", "spike_sequences", "spike_raw_sequence", SPIKE_DATASET),
        Family("images", "image_sets", "image_raw_set", IMAGE_DATASET),
    )
}
STORED: dict[str, StoredAsset] = {a.name: a for f in FAMILIES.values() for a in f.assets}
DATASETS: dict[str, Dataset] = {f.dataset.name: f.dataset for f in FAMILIES.values()}


def by_path(path: str) -> StoredAsset:
    """The declaration of the asset stored under ``path``."""
    for spec in STORED.values():
        if spec.path == path:
            return spec
    raise KeyError(f"no stored asset at {path!r}; known: {sorted(s.path for s in STORED.values())}")
