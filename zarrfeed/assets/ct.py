"""CT family: raw scan (any source) → HU volume → windows, sparse indices and patch index.

Every CT source — NIfTI files, DICOM series, ``.npy``/``.npz`` volumes in the raw folder, and
CT-RATE volumes from the Hugging Face hub — is a partition of the same ``ct_raw_scan`` asset
and flows through the same graph.  HU is decided from all the evidence
(``zarrfeed.transforms.hu``), never guessed; windows, sparse indices and patch index are one
subsettable step that reads the HU volume once.
"""

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np

from zarrfeed.assets.build import (
    Built,
    Step,
    build_partition,
    materialize_partitions,
    stored_asset,
    stored_multi_asset,
    upstream,
)
from zarrfeed.assets.metadata import png_markdown, table
from zarrfeed.assets.partitions import ct_scans
from zarrfeed.assets.raw import content_hash, raw_asset, resolve
from zarrfeed.formats import read_ct, read_nifti_header
from zarrfeed.formats.previews import volume_png
from zarrfeed.formats.volume import ZYX_AXES
from zarrfeed.resources import BuildOptions, CTSettings, HuggingFaceResource, ZarrStoreResource
from zarrfeed.sources.catalog import RawCatalog, RawItem
from zarrfeed.sources.raw import SourceWatch, ct_item, is_hub, source_identity
from zarrfeed.store import ZarrStore
from zarrfeed.store.contract import CT_HU, CT_PATCHES, CT_SPARSE, CT_WINDOWS, FAMILIES, SOURCE
from zarrfeed.transforms import ct, hu
from zarrfeed.transforms.patches import PatchGrid, patch_fractions
from zarrfeed.transforms.sparse import window_occupancy
from zarrfeed.transforms.stats import finite_range, int16_percentiles

VERIFY_POINTS = 2048
HU_PERCENTILES = (1, 5, 50, 95, 99)  # air, lung, soft tissue, bone at a glance
HuReader = Callable[[str], np.ndarray]  # partition key -> its HU volume


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


def _hu_step(
    catalog: RawCatalog,
    key: str,
    settings: Mapping[str, Any],
    local_path: Callable[[RawItem], Path],
) -> Step:
    item = resolve(catalog, key)
    sha = content_hash(catalog, item)
    preset = hu_preset(settings)
    state: dict[str, Any] = {}

    def source_hu() -> tuple[np.ndarray, tuple[float, float, float]]:
        """The full-resolution HU volume and its spacing, read once per build."""
        if "hu" not in state:
            vol = read_ct(ct_item(item, local_path(item)))
            csv = hu.Rescale(*item.evidence["csv"]) if "csv" in item.evidence else None
            data, decision = vol.to_hu(csv=csv, override=settings["hu_overrides"].get(key))
            state.update(hu=data, spacing=vol.spacing, decision=decision)
            step.attrs.update(
                source_spacing_zyx_mm=list(vol.spacing),
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

    def check(arrays: dict[str, np.ndarray]) -> dict[str, tuple[bool, dict]]:
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
            "hu_percentiles": table(
                ["percentile", "HU"],
                [[f"p{q:g}", v] for q, v in zip(HU_PERCENTILES, hu_at, strict=True)],
            ),
            "preview": png_markdown(png, title),
        }

    step = Step(
        inputs={SOURCE: source_identity(item, sha)},
        source=item.location,
        source_sha256=sha,
        produce=produce,
        check=check,
        describe=describe,
        attrs={"source_stamp": item.stamp, "source_kind": item.kind},
        watch=SourceWatch(item),
    )
    return step


def _windows(
    store: ZarrStore, settings: Mapping[str, Any], hu_of: HuReader
) -> Callable[[str], Step]:
    names = list(settings["windows"])

    def step(key: str) -> Step:
        def produce() -> dict[str, np.ndarray]:
            return ct.apply_windows(hu_of(key), names)

        def check(arrays: dict[str, np.ndarray]) -> dict[str, tuple[bool, dict]]:
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
            return {"windows": ", ".join(names), "preview": png_markdown(png, title)}

        return Step(
            inputs={"ct_hu": upstream(store, CT_HU, key)},
            source=store.partition_url(CT_HU.path, key),
            source_sha256=None,
            produce=produce,
            check=check,
            describe=describe,
        )

    return step


def _sparse(
    store: ZarrStore, settings: Mapping[str, Any], hu_of: HuReader, min_points: int
) -> Callable[[str], Step]:
    names, grid = list(settings["windows"]), settings["sparse_grid"] or None

    def step(key: str) -> Step:
        shape = tuple(store.commit_record(CT_HU.path, key)["arrays"]["hu"]["shape"])

        def produce() -> dict[str, np.ndarray]:
            return window_occupancy(hu_of(key), names, settings["sparse_threshold"], grid)

        def check(arrays: dict[str, np.ndarray]) -> dict[str, tuple[bool, dict]]:
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

        def describe(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
            return {f"points_{n}": len(c) for n, c in arrays.items()}

        return Step(
            inputs={"ct_hu": upstream(store, CT_HU, key)},
            source=store.partition_url(CT_HU.path, key),
            source_sha256=None,
            produce=produce,
            check=check,
            describe=describe,
        )

    return step


def _patches(
    store: ZarrStore, settings: Mapping[str, Any], hu_of: HuReader
) -> Callable[[str], Step]:
    patch, stride = tuple(settings["patch_zyx"]), tuple(settings["patch_stride_zyx"])
    minimum = settings["min_body_fraction"]

    def step(key: str) -> Step:
        shape = tuple(store.commit_record(CT_HU.path, key)["arrays"]["hu"]["shape"])
        grid = PatchGrid.make(
            shape, tuple(min(p, n) for p, n in zip(patch, shape, strict=True)), stride
        )

        def produce() -> dict[str, np.ndarray]:
            fractions = patch_fractions(hu_of(key) > settings["body_hu"], grid)
            keep = np.flatnonzero(fractions >= minimum)
            return {"origins": grid.origins(keep).astype(np.uint16), "fraction": fractions[keep]}

        def check(arrays: dict[str, np.ndarray]) -> dict[str, tuple[bool, dict]]:
            origins, frac = arrays["origins"], arrays["fraction"]
            inside = bool(((origins + np.array(grid.patch)) <= np.array(shape)).all())
            return {
                "non_empty": (len(origins) > 0, {"patches": len(origins), "of": len(grid)}),
                "in_bounds": (
                    inside and bool((frac >= minimum).all()),
                    {"patch": list(grid.patch), "volume": list(shape)},
                ),
            }

        def describe(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
            return {"patches_kept": len(arrays["origins"]), "patches_total": len(grid)}

        return Step(
            inputs={"ct_hu": upstream(store, CT_HU, key)},
            source=store.partition_url(CT_HU.path, key),
            source_sha256=None,
            produce=produce,
            check=check,
            describe=describe,
            attrs={"volume_shape": list(shape), "patch_shape": list(grid.patch)},
        )

    return step


def ct_assets(settings: Mapping[str, Any]) -> list[dg.AssetsDefinition]:
    """The CT family's assets, their code versions derived from ``settings``."""
    ct_raw_scan = raw_asset(
        FAMILIES["ct"],
        describe_scan,
        "A raw CT scan of any source — NIfTI file, DICOM series, .npy/.npz volume, CT-RATE "
        "volume on the hub: its content hash (the data version) and header facts.",
    )

    @stored_asset(CT_HU, settings, ct_scans, deps=["ct_raw_scan"])
    def ct_hu(
        context: dg.AssetExecutionContext,
        zarr_store: ZarrStoreResource,
        ct_settings: CTSettings,
        build: BuildOptions,
        hf: HuggingFaceResource,
    ) -> dg.MaterializeResult:
        store, catalog, values = zarr_store.store(), zarr_store.catalog("ct"), ct_settings.values()
        hub = functools.cache(hf.hub)

        def local_path(item: RawItem) -> Path:
            if not is_hub(item):
                return Path(item.location)
            return hub().download(item.detail["path"], item.detail["commit"])

        def one(key: str) -> Built:
            built = build_partition(
                store, CT_HU, key, values, build.force, _hu_step(catalog, key, values, local_path)
            )
            item = catalog.get(key)
            if hf.delete_after_commit and item is not None and is_hub(item):
                hub().forget(local_path(item))
            return built

        return materialize_partitions(context, one)

    derived = {"ct_windows": CT_WINDOWS, "ct_sparse": CT_SPARSE, "ct_patches": CT_PATCHES}

    @stored_multi_asset(
        "ct_derived",
        list(derived.values()),
        settings,
        ct_scans,
        deps={name: ["ct_hu"] for name in derived},
    )
    def ct_derived(
        context: dg.AssetExecutionContext,
        zarr_store: ZarrStoreResource,
        ct_settings: CTSettings,
        build: BuildOptions,
    ) -> Iterator[dg.MaterializeResult]:
        """Windows, sparse indices and patch index of a scan in one step (any subset of them),
        all computed from the HU volume read once per partition."""
        store, values = zarr_store.store(), ct_settings.values()
        hu_of = functools.lru_cache(maxsize=1)(lambda key: store.read_array(CT_HU.path, key, "hu"))
        steps = {
            "ct_windows": _windows(store, values, hu_of),
            "ct_sparse": _sparse(store, values, hu_of, ct_settings.min_points),
            "ct_patches": _patches(store, values, hu_of),
        }
        for name, spec in derived.items():
            if dg.AssetKey(name) in context.selected_asset_keys:
                make = steps[name]
                yield materialize_partitions(
                    context,
                    lambda key, spec=spec, make=make: build_partition(
                        store, spec, key, values, build.force, make(key)
                    ),
                    dg.AssetKey(name),
                )

    return [ct_raw_scan, ct_hu, ct_derived]
