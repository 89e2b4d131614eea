"""Spike family: raw sequence → spike voxel bins, and the blur/sharp frames.

One partition per sequence folder; arrays are (samples, …) so a training clip is a slice.
"""

from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
import numpy as np

from zarrfeed.assets.build import Step, build_partition, materialize_partitions, stored_asset
from zarrfeed.assets.metadata import png_markdown
from zarrfeed.assets.partitions import spike_sequences
from zarrfeed.assets.raw import content_hash, raw_asset, resolve
from zarrfeed.errors import InputError
from zarrfeed.formats import read_dat, read_image
from zarrfeed.formats.discover import SpikeSequence
from zarrfeed.formats.limits import claimed_bytes, require_allocatable
from zarrfeed.formats.previews import grid_png
from zarrfeed.resources import BuildOptions, SpikeSettings, ZarrStoreResource
from zarrfeed.sources.catalog import RawCatalog, RawItem
from zarrfeed.sources.raw import SourceWatch, source_identity, spike_sequence
from zarrfeed.store.contract import FAMILIES, SOURCE, SPIKE_FRAMES, SPIKE_VOXELS, StoredAsset
from zarrfeed.transforms import spike as sp


def describe_sequence(item: RawItem) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    """Facts of a sequence; an incomplete sample fails the step naming its missing files
    (:meth:`SpikeSequence.samples`, the notion the build and discovery share)."""
    seq = spike_sequence(item)
    samples = seq.samples()
    facts = {
        "samples": len(samples),
        "height": seq.height,
        "width": seq.width,
        "layout": f"{seq.spike_folder} ({seq.layout}, {seq.frames} frames per sample)",
    }
    return facts, bool(samples), {"samples": len(samples), "files": len(seq.files())}


def _sequence_step(
    catalog: RawCatalog,
    key: str,
    produce: Callable[[SpikeSequence, list[str]], dict[str, np.ndarray]],
    check: Callable[[SpikeSequence, list[str], dict[str, np.ndarray]], dict],
    describe: Callable[[dict[str, np.ndarray]], dict[str, Any]],
) -> Step:
    item = resolve(catalog, key)
    sha, seq = content_hash(catalog, item), spike_sequence(item)
    watch = SourceWatch(item)  # before the listing: a sample added after it shows
    samples = seq.samples()
    if not samples:
        raise InputError(seq.folder, f"samples in {seq.spike_folder}/, blur/ and sharp/", "none")
    return Step(
        inputs={SOURCE: source_identity(item, sha)},
        source=item.location,
        source_sha256=sha,
        produce=lambda: produce(seq, samples),
        check=lambda arrays: check(seq, samples, arrays),
        describe=describe,
        attrs={
            "source_stamp": item.stamp,
            "samples": samples,
            "layout": seq.layout,
            "frames": seq.frames,
            "spike_folder": seq.spike_folder,
        },
        watch=watch,
    )


def _voxels(bins: int) -> tuple[Callable, Callable, Callable]:
    def produce(seq: SpikeSequence, samples: list[str]) -> dict[str, np.ndarray]:
        shape = (len(samples), bins, seq.height, seq.width)
        what = f"{'×'.join(map(str, shape))} uint8 voxel bins"
        require_allocatable(seq.folder, claimed_bytes(shape, 1), what, "spike")
        out = np.empty(shape, np.uint8)
        for i, stem in enumerate(samples):
            path = seq.folder / seq.spike_folder / f"{stem}.dat"
            out[i] = sp.voxel_bins(
                read_dat(path, seq.height, seq.width, seq.layout, seq.frames), bins
            )
        return {"voxels": out}

    def check(seq: SpikeSequence, samples: list[str], arrays: dict) -> dict:
        voxels = arrays["voxels"]
        widest = int(np.diff(sp.bin_edges(seq.frames, bins)).max())
        expected = (len(samples), bins, seq.height, seq.width)
        ok = voxels.shape == expected and int(voxels.max(initial=0)) <= widest
        facts = {"shape": str(voxels.shape), "max": int(voxels.max(initial=0)), "allowed": widest}
        return {"counts_valid": (bool(ok), facts)}

    def describe(arrays: dict) -> dict[str, Any]:
        voxels = arrays["voxels"]
        top = max(1, int(voxels.max(initial=0)))
        title = f"sample 0: spike counts per bin (of {top} at most)"
        bins_png = grid_png(
            {"sample 0": [b / top for b in voxels[0]]},
            [f"bin {b}" for b in range(voxels.shape[1])],
            title,
        )
        return {"samples": len(voxels), "preview": png_markdown(bins_png, title)}

    return produce, check, describe


def _frames(seq: SpikeSequence, samples: list[str]) -> dict[str, np.ndarray]:
    out = {}
    for kind in ("blur", "sharp"):
        shape = (len(samples), seq.height, seq.width, 3)
        what = f"{'×'.join(map(str, shape))} uint8 {kind} frames"
        require_allocatable(seq.folder, claimed_bytes(shape, 1), what, "spike")
        frames = np.empty(shape, np.uint8)
        for i, stem in enumerate(samples):
            path = seq.folder / kind / f"{stem}.png"
            img = read_image(path)
            if img.shape != frames.shape[1:] or img.dtype != np.uint8:
                raise InputError(
                    path, f"uint8 {frames.shape[1:]} (dataset.json)", f"{img.dtype} {img.shape}"
                )
            frames[i] = img
        out[kind] = frames
    return out


def _frames_check(seq: SpikeSequence, samples: list[str], arrays: dict) -> dict:
    want = (len(samples), seq.height, seq.width, 3)
    shapes = {k: a.shape for k, a in arrays.items()}
    return {
        "frames_aligned": (
            all(s == want for s in shapes.values()),
            {k: str(s) for k, s in shapes.items()},
        )
    }


def spike_assets(settings: Mapping[str, Any]) -> list[dg.AssetsDefinition]:
    """The spike family's assets, their code versions derived from ``settings``."""
    raw = raw_asset(
        FAMILIES["spike"],
        describe_sequence,
        "A raw spike sequence folder: one hash over its files (the data version) and layout.",
    )

    def family_asset(spec: StoredAsset, parts: Callable[[Mapping], tuple]) -> dg.AssetsDefinition:
        @stored_asset(spec, settings, spike_sequences, deps=[raw.key.path[0]])
        def _asset(
            context: dg.AssetExecutionContext,
            zarr_store: ZarrStoreResource,
            spike_settings: SpikeSettings,
            build: BuildOptions,
        ) -> dg.MaterializeResult:
            store, catalog = zarr_store.store(), zarr_store.catalog("spike")
            values = spike_settings.values()
            produce, check, describe = parts(values)
            return materialize_partitions(
                context,
                lambda key: build_partition(
                    store,
                    spec,
                    key,
                    values,
                    build.force,
                    _sequence_step(catalog, key, produce, check, describe),
                ),
            )

        return _asset

    voxels = family_asset(SPIKE_VOXELS, lambda v: _voxels(v["bins"]))
    frames = family_asset(
        SPIKE_FRAMES,
        lambda v: (
            _frames,
            _frames_check,
            lambda a: {
                "preview": png_markdown(
                    grid_png(
                        {"sample 0": [a["blur"][0], a["sharp"][0]]}, ["blur", "sharp"], "frames"
                    ),
                    "sample 0: blurred and sharp frame",
                )
            },
        ),
    )
    return [raw, voxels, frames]
