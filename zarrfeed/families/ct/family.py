"""The CT family: a raw scan of any source → HU volume → windows, sparse indices, patch index.

Every CT source — NIfTI files, DICOM series, ``.npy``/``.npz`` volumes in the raw folder, and
CT-RATE volumes from the Hugging Face hub — is a partition of the same raw asset and flows
through the same stages.  HU is decided from all the evidence (``zarrfeed.transforms.hu``),
never guessed; windows, sparse indices and patch index are built in one step that reads the
HU volume once.  The dataset carries the patch index as one table and CT-RATE's labels.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from zarrfeed.errors import InputError, StoreError
from zarrfeed.families.ct.discover import ct_item, scan_ct, scan_files
from zarrfeed.families.ct.tables import UNKNOWN_LABEL, read_ct_rate_labels
from zarrfeed.families.facts import Picture, Rows
from zarrfeed.families.family import Extra, Family, HubSource, RawSource, Reader, Stage, Table
from zarrfeed.families.stages import Checks, Inputs, Step
from zarrfeed.formats.ct import read_ct
from zarrfeed.formats.previews import volume_png
from zarrfeed.formats.volume import OBLIQUE_TOLERANCE_RAD, ZYX_AXES, Volume, off_axis_angle
from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import is_hub
from zarrfeed.store import ZarrStore
from zarrfeed.store.contract import ArraySpec, Check, StoredAsset
from zarrfeed.transforms import ct, hu
from zarrfeed.transforms.augment.ops import Affine, Flip, Intensity, Noise, Rot90
from zarrfeed.transforms.patches import PatchGrid, patch_fractions
from zarrfeed.transforms.sparse import window_occupancy
from zarrfeed.transforms.stats import finite_range, int16_percentiles

VERIFY_POINTS = 2048
HU_PERCENTILES = (1, 5, 50, 95, 99)  # air, lung, soft tissue, bone at a glance
ZYX = ("z", "y", "x")


class CTSettings(BaseModel):
    """How CT volumes are turned into HU, windows, sparse indices and the patch index.

    The CT-CLIP geometry is ``spacing_zyx_mm=[1.5, 0.75, 0.75]``,
    ``crop_pad_zyx=[240, 480, 480]`` and the ``ct-clip`` window ([-1000, 1000] HU).
    """

    model_config = ConfigDict(extra="forbid")

    spacing_zyx_mm: list[float] = [1.5, 0.75, 0.75]
    crop_pad_zyx: list[int] = Field([], description="empty: keep the resampled extent")
    hu_overrides: dict[str, Any] = Field(
        {}, description="scan key: 'hu' (stored values are HU) or {slope, intercept}"
    )
    oblique: Literal["resample", "refuse"] = Field(
        "resample",
        description="a scan rotated off the axes: resampled onto the axis-aligned grid of "
        "spacing_zyx_mm (recorded in the partition's geometry), or refused",
    )
    windows: list[str] = ["lung", "mediastinum", "bone"]
    sparse_threshold: float = Field(
        0.5, description="a voxel is occupied where its windowed value exceeds this"
    )
    sparse_grid: int = Field(64, description="occupancy grid edge (TRELLIS 64³); 0: full size")
    min_points: int = 16
    patch_zyx: list[int] = [64, 64, 64]
    patch_stride_zyx: list[int] = [64, 64, 64]
    body_hu: float = Field(-500.0, description="voxels above this count as body (patches)")
    min_body_fraction: float = 0.25

    @field_validator("hu_overrides")
    @classmethod
    def _overrides(cls, value: dict[str, Any]) -> dict[str, Any]:
        hu.parse_overrides(value)  # a config error now, not a failed partition later
        return value

    @field_validator("windows")
    @classmethod
    def _windows(cls, value: list[str]) -> list[str]:
        for name in value:
            ct.get_window(name)
        return value


IN_BOUNDS = Check("in_bounds", "Every index lies inside the array it indexes.")
NON_EMPTY = Check("non_empty", "At least one patch passed the filter.")

CT_HU = StoredAsset(
    name="ct_hu",
    path="ct/hu",
    family="ct",
    # 3: DICOM reoriented to (S, A, R); NIfTI units and method-1 geometry.
    # 4: an oblique scan resampled onto the axis-aligned grid, not its rotation dropped.
    version="4",
    arrays=(ArraySpec("hu", ZYX, "int16"),),
    description=(
        "CT volume in Hounsfield units (int16), the rescale decided from all the evidence, "
        "padding turned to air, resampled to the configured spacing, optionally cropped or "
        "padded to a fixed shape, clipped to [-1024, 3071].  An oblique scan is resampled "
        "onto the axis-aligned grid (or refused, by the oblique setting)."
    ),
    params=("spacing_zyx_mm", "crop_pad_zyx", "oblique"),
    keyed_params=("hu_overrides",),
    checks=(
        Check("hu_range", "HU volume is int16, non-empty and inside the preset's clip range."),
        Check(
            "hu_plausible",
            "Air sits near -1000 HU and soft tissue is present: a volume off by 1024 HU (a "
            "rescale applied twice or not at all) can never pass.",
        ),
        Check(
            "matches_source",
            "An independent trilinear recomputation from the source at 2,048 random voxels "
            "agrees within 1 HU, and the shape follows from the spacing.",
        ),
    ),
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
    inputs=(CT_HU.name,),
    checks=(Check("window_range", "Every window is float16, finite and inside [0, 1]."),),
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
    params=("windows", "sparse_threshold", "sparse_grid", "min_points"),  # min_points: its check
    per_dataset=("sparse_grid",),  # the sparse task sizes its model from one grid
    inputs=(CT_HU.name,),
    checks=(Check("min_points", "Every window has at least min_points occupied cells."), IN_BOUNDS),
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
    per_dataset=("patch_zyx",),  # CTPatchDataset cuts every patch to one shape
    inputs=(CT_HU.name,),
    checks=(NON_EMPTY, IN_BOUNDS),
)
PATCH_TABLE = Table("patches", CT_PATCHES, ("origins", "fraction"))
LABELS = "labels"  # the dataset's CT-RATE label table (and the hub listing's)
HUB = HubSource(
    asset="hub_ct_catalog",
    job="hub_catalog",
    path="hub/catalog",
    version="2",
    check=Check("non_empty", "The listing found at least one volume."),
    labels=LABELS,
)


def window_label(name: str) -> str:
    """``lung W1500 L-600``: a preview row names its window's width and level."""
    w = ct.get_window(name)
    return f"{name} W{w.width:g} L{w.level:g}"


def hu_preset(settings: Mapping[str, Any]) -> ct.CTPreset:
    """The HU recipe the settings describe (CT-CLIP's geometry with ``crop_pad_zyx``)."""
    shape = tuple(settings["crop_pad_zyx"]) or None
    return replace(ct.HU_ISOTROPIC, spacing=tuple(settings["spacing_zyx_mm"]), shape=shape)


def describe_scan(item: RawItem) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    """Header facts of a raw scan without decoding its voxels."""
    if is_hub(item):
        return {"revision": item.detail.get("commit", "")}, item.size > 0, {"bytes": item.size}
    files = ct_item(item).sources()
    facts: dict[str, Any] = {"files": len(files)}
    if item.kind == "nifti":
        from zarrfeed.formats.nifti import read_nifti_header  # nibabel: only when described

        header = read_nifti_header(item.location)
        facts |= {
            "shape_zyx": str(header.shape),
            "spacing_zyx_mm": str(tuple(round(s, 4) for s in header.spacing)),
            "stored_dtype": header.meta["dtype"],
            "orientation_on_disk": header.meta["orientation_on_disk"],
        }
        ok = min(header.shape) > 1 and min(header.spacing) > 0
    else:
        ok = all(f.stat().st_size > 0 for f in files)
    return facts, ok, {k: v for k, v in facts.items() if k != "files"}


def axis_aligned_hu(
    vol: Volume,
    target: tuple[float, float, float],
    oblique: str = "resample",
    csv: hu.Rescale | None = None,
    override: Any = None,
) -> tuple[np.ndarray, tuple[float, float, float], hu.HuDecision, dict[str, Any]]:
    """HU of ``vol`` on axis-aligned (S, A, R) voxel axes, its spacing, the HU decision and
    the geometry for provenance.

    The readers bring every scan to the nearest axes; a rotation left over beyond
    :data:`OBLIQUE_TOLERANCE_RAD` is an oblique scan.  With ``oblique="resample"`` it is
    resampled trilinearly onto the axis-aligned grid of spacing ``target`` covering the
    scan (air outside, :func:`zarrfeed.transforms.ct.align_to_axes`); with ``"refuse"`` it is
    an :class:`InputError` naming the file and the angle.
    """
    data, decision = vol.to_hu(csv=csv, override=override)
    angle = off_axis_angle(vol.affine) if vol.affine is not None else 0.0
    geometry: dict[str, Any] = {"off_axis_deg": round(float(np.degrees(angle)), 4)}
    if vol.affine is not None:
        geometry["affine_ras"] = np.round(vol.affine, 6).tolist()
    if angle <= OBLIQUE_TOLERANCE_RAD:
        return data, vol.spacing, decision, geometry | {"resampled": False}
    found = f"voxel axes {np.degrees(angle):.2f}° off the nearest world axes (an oblique scan)"
    if oblique != "resample":
        raise InputError(vol.source, "an axis-aligned scan (CT setting oblique: refuse)", found)
    data, grid = ct.align_to_axes(data, vol.affine, target, fill=hu.AIR_FILL)
    geometry |= {"resampled": True, "affine_resampled": np.round(grid, 6).tolist()}
    return data, tuple(float(t) for t in target), decision, geometry


def hu_step(inputs: Inputs, key: str) -> Step:
    """HU volume of a raw scan: read (downloaded first when on the hub), rescaled as the
    evidence decides, resampled, clipped; checked against an independent recomputation."""
    item, sha, identity = inputs.source(key)
    settings = inputs.settings
    preset = hu_preset(settings)
    state: dict[str, Any] = {}
    # Provenance the read adds.  Not through ``step``: a closure holding the step that holds
    # it is a reference cycle, which would keep the full-resolution volume alive after the
    # build until the collector happens to run (hundreds of MB per partition).
    attrs: dict[str, Any] = {
        "source_stamp": item.stamp,
        "source_kind": item.kind,
        "links": inputs.links(item),  # link → target, its hash (ZARRFEED_RAW_LINKS)
    }

    def source_hu() -> tuple[np.ndarray, tuple[float, float, float]]:
        """The full-resolution HU volume and its spacing, read once per build."""
        if "hu" not in state:
            vol = read_ct(ct_item(item, inputs.local(item)))
            csv = hu.Rescale(*item.evidence["csv"]) if "csv" in item.evidence else None
            override = settings["hu_overrides"].get(key)
            data, spacing, decision, geometry = axis_aligned_hu(
                vol, preset.spacing, settings["oblique"], csv=csv, override=override
            )
            state.update(hu=data, spacing=spacing, decision=decision)
            attrs.update(
                source_spacing_zyx_mm=list(vol.spacing),
                geometry=geometry,
                hu_rescale={
                    "slope": decision.slope,
                    "intercept": decision.intercept,
                    "decided_by": decision.source,
                    "evidence": decision.evidence,
                },
            )
        return state["hu"], state["spacing"]

    def produce() -> dict[str, np.ndarray]:
        data, spacing = source_hu()
        return {"hu": ct.preprocess(data, spacing, preset)}

    def check(arrays: dict[str, np.ndarray]) -> Checks:
        out = arrays["hu"]
        lo, hi = preset.clip
        in_range = bool(out.dtype == np.int16 and out.size and out.min() >= lo and out.max() <= hi)
        data, spacing = source_hu()  # also the decision: an override is judged as one
        overridden = state["decision"].source == "override"
        plausible, facts = hu.hu_plausibility(out, overridden=overridden)
        resampled = ct.resampled_shape(data.shape, spacing, preset.spacing)
        if preset.shape is not None:
            shape_ok, error = out.shape == preset.shape, 0.0  # cropped/padded: shape only
        else:
            rng = np.random.default_rng(0)
            points = np.stack([rng.integers(0, n, VERIFY_POINTS) for n in out.shape], axis=1)
            expected = np.clip(ct.sample_resampled(data, out.shape, points), lo, hi)
            error = float(np.abs(out[tuple(points.T)] - expected).max())
            shape_ok = out.shape == resampled
        return {
            "hu_range": (
                in_range,
                {"min": int(out.min()), "max": int(out.max()), "dtype": str(out.dtype)},
            ),
            "hu_plausible": (plausible, {k: v for k, v in facts.items() if v is not None}),
            # Rounding to int16 is the only difference allowed against the recomputation.
            "matches_source": (
                shape_ok and error <= 1.0,
                {"max_abs_error_hu": error, "points": VERIFY_POINTS, "shape_ok": shape_ok},
            ),
        }

    def describe(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        out = arrays["hu"]
        shape = "×".join(map(str, out.shape))
        title = f"HU volume {key} ({shape}), lung window"
        png = volume_png(
            {window_label("lung"): out},
            title,
            preset.spacing,
            view=lambda s: ct.apply_window(s, "lung", "float32"),
            axes=ZYX_AXES,
        )
        hu_at = int16_percentiles(out, HU_PERCENTILES)
        return {
            "shape_zyx": shape,
            "spacing_zyx_mm": " × ".join(f"{s:g}" for s in preset.spacing),
            "orientation_zyx": ZYX_AXES,
            "hu_percentiles": Rows(
                ["percentile", "HU"],
                [[f"p{q:g}", v] for q, v in zip(HU_PERCENTILES, hu_at, strict=True)],
            ),
            "preview": Picture(png, title),
        }

    return Step(
        inputs=identity,
        source=item.location,
        source_sha256=sha,
        produce=produce,
        check=check,
        describe=describe,
        attrs=attrs,
        watch=inputs.watch(item),
    )


def _from_hu(inputs: Inputs, key: str, **step: Any) -> Step:
    """A step built on partition ``key`` of the HU volume."""
    return Step(
        inputs=inputs.upstream(key, CT_HU),
        source=inputs.store.partition_url(CT_HU.path, key),
        source_sha256=None,
        **step,
    )


def hu_of(inputs: Inputs, key: str) -> np.ndarray:
    return inputs.read(CT_HU, key, "hu")


def windows_step(inputs: Inputs, key: str) -> Step:
    settings = inputs.settings
    names = list(settings["windows"])

    def check(arrays: dict[str, np.ndarray]) -> Checks:
        bad = {}
        for name, d in arrays.items():
            lo, hi, finite = finite_range(d)
            if not (d.dtype == np.float16 and finite and lo >= 0 and hi <= 1):
                bad[name] = [str(d.dtype), lo, hi, finite]
        return {"window_range": (not bad, {"out_of_range": bad})}

    def describe(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        title = f"{key}: {', '.join(names)} windows"
        png = volume_png(
            {window_label(n): arrays[n] for n in names},
            title,
            settings["spacing_zyx_mm"],
            axes=ZYX_AXES,
        )
        return {"windows": ", ".join(names), "preview": Picture(png, title)}

    return _from_hu(
        inputs,
        key,
        produce=lambda: ct.apply_windows(hu_of(inputs, key), names),
        check=check,
        describe=describe,
    )


def sparse_step(inputs: Inputs, key: str) -> Step:
    settings = inputs.settings
    names, grid = list(settings["windows"]), settings["sparse_grid"] or None
    min_points = settings["min_points"]
    shape = inputs.shape(CT_HU, key, "hu")

    def produce() -> dict[str, np.ndarray]:
        return window_occupancy(hu_of(inputs, key), names, settings["sparse_threshold"], grid)

    def check(arrays: dict[str, np.ndarray]) -> Checks:
        bound = np.array((grid,) * 3 if grid else shape)
        counts = {n: len(c) for n, c in arrays.items()}
        bad = {
            n: str(c.dtype)
            for n, c in arrays.items()
            if c.dtype != np.uint16 or c.ndim != 2 or (c >= bound).any()
        }
        return {
            "min_points": (
                min(counts.values()) >= min_points,
                {"points": counts, "min_points": min_points},
            ),
            "in_bounds": (not bad, {"bad": bad}),
        }

    return _from_hu(
        inputs,
        key,
        produce=produce,
        check=check,
        describe=lambda arrays: {f"points_{n}": len(c) for n, c in arrays.items()},
    )


def patches_step(inputs: Inputs, key: str) -> Step:
    settings = inputs.settings
    patch, stride = tuple(settings["patch_zyx"]), tuple(settings["patch_stride_zyx"])
    minimum = settings["min_body_fraction"]
    shape = inputs.shape(CT_HU, key, "hu")
    grid = PatchGrid.make(
        shape, tuple(min(p, n) for p, n in zip(patch, shape, strict=True)), stride
    )

    def produce() -> dict[str, np.ndarray]:
        fractions = patch_fractions(hu_of(inputs, key) > settings["body_hu"], grid)
        keep = np.flatnonzero(fractions >= minimum)
        return {"origins": grid.origins(keep).astype(np.uint16), "fraction": fractions[keep]}

    def check(arrays: dict[str, np.ndarray]) -> Checks:
        origins, frac = arrays["origins"], arrays["fraction"]
        inside = bool(((origins + np.array(grid.patch)) <= np.array(shape)).all())
        return {
            "non_empty": (len(origins) > 0, {"patches": len(origins), "of": len(grid)}),
            "in_bounds": (
                inside and bool((frac >= minimum).all()),
                {"patch": list(grid.patch), "volume": list(shape)},
            ),
        }

    return _from_hu(
        inputs,
        key,
        produce=produce,
        check=check,
        describe=lambda a: {"patches_kept": len(a["origins"]), "patches_total": len(grid)},
        attrs={"volume_shape": list(shape), "patch_shape": list(grid.patch)},
    )


def hub_labels(store: ZarrStore) -> tuple[list[str], dict[str, list[int]]]:
    """CT-RATE labels of every hub split listed into the store (names, key → row)."""
    names: list[str] = []
    rows: dict[str, list[int]] = {}
    for split in store.list_partitions(HUB.path):
        attrs = store.commit_record(HUB.path, split)["attrs"]
        if not attrs.get("label_names"):
            continue
        names = attrs["label_names"]
        table = store.read_array(HUB.path, split, HUB.labels)
        rows.update({k: list(map(int, r)) for k, r in zip(attrs["keys"], table, strict=True)})
    return names, rows


def write_labels(store: ZarrStore, raw_root: str, keys: list[str], path: str) -> dict[str, Any]:
    """CT-RATE labels aligned with the dataset's keys (raw-folder CSVs, then hub splits)."""
    names, rows = read_ct_rate_labels(raw_root)
    hub_names, hub_rows = hub_labels(store)
    if hub_names and names and hub_names != names:
        raise StoreError(f"label columns of the hub {hub_names} differ from {raw_root}'s {names}")
    names, rows = names or hub_names, {**hub_rows, **rows}
    if not names:
        return {}
    unknown = [UNKNOWN_LABEL] * len(names)
    table = np.array([rows.get(k, unknown) for k in keys], dtype=np.uint8)
    attrs = {"names": names, "keys": keys, "unknown": UNKNOWN_LABEL}
    with store.write_partition(path, LABELS, attrs) as w:
        w.write(LABELS, table.reshape(len(keys), len(names)), read="whole")
    digest = hashlib.sha256(table.tobytes() + json.dumps(names).encode()).hexdigest()
    return {"labelled": sum(k in rows for k in keys), "labels_sha256": digest[:16]}


# CT patches (N, 1, z, y, x), windows in [0, 1]: flips on every axis, quarter turns in the
# axial plane, a small affine, mild intensity changes and noise.
RECIPE = "ct"  # its augmentation recipe: what its tasks augment with by default
AUGMENT: dict[str, Any] = {
    "keys": {"image": "image"},
    "flip": Flip(p=0.5, axes=(0, 1, 2)),
    "rot90": Rot90(p=0.5, axes=(1, 2)),
    "affine": Affine(p=0.2, rotate=10.0, scale=(0.9, 1.1)),
    "intensity": Intensity(p=0.5, scale=(0.9, 1.1), shift=(-0.05, 0.05)),
    "noise": Noise(p=0.3, std=(0.0, 0.03)),
}

CT = Family(
    name="ct",
    partitions="ct_scans",
    raw=RawSource(
        asset="ct_raw_scan",
        items="CT scans",
        description="A raw CT scan of any source — NIfTI file, DICOM series, .npy/.npz "
        "volume, CT-RATE volume on the hub: its content hash (the data version) and header "
        "facts.",
        kinds=frozenset({"nifti", "dicom", "numpy"}),
        scan=scan_ct,
        files=scan_files,
        describe=describe_scan,
        readable=Check(
            "readable", "The raw item opens and its header gives a plausible shape and spacing."
        ),
        version="2",
    ),
    settings=CTSettings,
    stages=(
        Stage(CT_HU, hu_step),
        Stage(CT_WINDOWS, windows_step, step="ct_derived"),
        Stage(CT_SPARSE, sparse_step, step="ct_derived"),
        Stage(CT_PATCHES, patches_step, step="ct_derived"),
    ),
    tables=(PATCH_TABLE,),
    extras=(Extra(LABELS, write_labels),),
    dataset_version="2",
    hub=HUB,
    readers=(
        Reader("ct-patches", "zarrfeed.families.ct.datasets:CTPatchDataset"),
        Reader("ct-volumes", "zarrfeed.families.ct.datasets:CTPatchDataset", {"patch": False}),
        Reader("sparse", "zarrfeed.families.ct.datasets:SparsePointsDataset"),
    ),
    tasks=(
        "zarrfeed.families.ct.tasks:CTClassification",
        "zarrfeed.families.ct.tasks:SparseAutoencoder",
    ),
    augment={RECIPE: AUGMENT},
)
