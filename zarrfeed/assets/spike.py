"""Spike branch (seed 001): raw sequence → spike voxel bins, and the blur/sharp frames.

One partition per sequence folder; arrays are (samples, …) so a training clip is a slice.
"""

import hashlib
import time

import dagster as dg
import numpy as np

from zarrfeed.assets.build import (
    Built,
    fingerprint,
    materialize_partitions,
    partitioned_asset,
    report,
    reuse,
)
from zarrfeed.assets.metadata import preview
from zarrfeed.assets.partitions import spike_sequences
from zarrfeed.errors import InputError
from zarrfeed.formats import read_dat, read_image
from zarrfeed.formats.discover import SpikeSequence
from zarrfeed.resources import BuildOptions, RawFolderResource, SpikeSettings, ZarrStoreResource
from zarrfeed.store import file_sha256, provenance
from zarrfeed.transforms import spike as sp

VOXELS_ASSET, FRAMES_ASSET = "spike/voxels", "spike/frames"
SPIKE_STORE_ASSETS = (VOXELS_ASSET, FRAMES_ASSET)
VERSIONS = {VOXELS_ASSET: "1", FRAMES_ASSET: "1"}


def _sequence(raw: RawFolderResource, found: dict[str, SpikeSequence], key: str) -> SpikeSequence:
    seq = found.get(key)
    if seq is None:
        raise dg.Failure(f"no spike sequence {key!r} under {raw.root} (was it removed?)")
    if not seq.samples():
        raise InputError(seq.folder, f"samples in {seq.spike_folder}/, blur/ and sharp/", "none")
    return seq


def folder_sha256(seq: SpikeSequence) -> str:
    """One hash over every file of the sequence (names and contents)."""
    h = hashlib.sha256()
    for path in seq.files():
        h.update(f"{path.relative_to(seq.folder)}\0{file_sha256(path)}\n".encode())
    return h.hexdigest()


@partitioned_asset(
    partitions_def=spike_sequences,
    group="spike",
    code_version="1",
    checks=("complete",),
    batched=False,
)
def spike_raw_sequence(
    context: dg.AssetExecutionContext, raw: RawFolderResource
) -> dg.MaterializeResult:
    """A raw sequence folder: one hash over its files (the data version) and its layout."""
    seq = _sequence(raw, raw.spike_sequences(), context.partition_key)
    samples = seq.samples()
    per_folder = {
        sub: len(list((seq.folder / sub).glob("*"))) for sub in (seq.spike_folder, "blur", "sharp")
    }
    return dg.MaterializeResult(
        data_version=dg.DataVersion(folder_sha256(seq)),
        metadata={
            "path": dg.MetadataValue.path(str(seq.folder)),
            "samples": len(samples),
            "height": seq.height,
            "width": seq.width,
            "layout": f"{seq.spike_folder} ({seq.layout}, {seq.frames} frames per sample)",
            "files_per_folder": dg.MetadataValue.json(per_folder),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name="complete",  # every sample has spikes, blur and sharp
                passed=len(set(per_folder.values())) == 1,
                metadata={"files_per_folder": per_folder},
            )
        ],
    )


@partitioned_asset(
    partitions_def=spike_sequences,
    group="spike",
    code_version=VERSIONS[VOXELS_ASSET],
    checks=("counts_valid",),
    deps=(spike_raw_sequence,),
)
def spike_voxels(
    context: dg.AssetExecutionContext,
    raw: RawFolderResource,
    zarr_store: ZarrStoreResource,
    spike_settings: SpikeSettings,
    build: BuildOptions,
) -> dg.MaterializeResult:
    """uint8 (samples, bins, H, W) spike counts: each sample's camera frames summed per bin."""
    store, found, bins = zarr_store.store(), raw.spike_sequences(), spike_settings.bins

    def one(key: str) -> Built:
        seq = _sequence(raw, found, key)
        samples = seq.samples()
        params = {"bins": bins, "layout": seq.layout, "frames": seq.frames, "samples": samples}
        sha = folder_sha256(seq)
        fp = fingerprint(VERSIONS[VOXELS_ASSET], params, {"source_sha256": sha})
        seconds = None
        if not reuse(store, VOXELS_ASSET, key, fp, build.force):
            t0 = time.perf_counter()
            attrs = provenance(str(seq.folder), sha, VERSIONS[VOXELS_ASSET], params, fingerprint=fp)
            with store.write_partition(VOXELS_ASSET, key, attrs) as w:
                shape = (len(samples), bins, seq.height, seq.width)
                arr = w.create(
                    "voxels",
                    shape,
                    np.uint8,
                    content="events",
                    chunks=(1, *shape[1:]),
                    dimension_names=("sample", "bin", "y", "x"),
                )
                for i, stem in enumerate(samples):
                    path = seq.folder / seq.spike_folder / f"{stem}.dat"
                    spikes = read_dat(path, seq.height, seq.width, seq.layout, seq.frames)
                    arr[i] = sp.voxel_bins(spikes, bins)
            seconds = time.perf_counter() - t0
        voxels = store.read_array(VOXELS_ASSET, key, "voxels")
        widest = int(np.diff(sp.bin_edges(seq.frames, bins)).max())
        expected = (len(samples), bins, seq.height, seq.width)
        ok = voxels.shape == expected and voxels.dtype == np.uint8 and int(voxels.max()) <= widest
        return Built(
            metadata=report(
                store,
                VOXELS_ASSET,
                key,
                seconds,
                samples=len(samples),
                mean_firing_rate=round(float(voxels.mean()) / (seq.frames / bins), 4),
                preview=preview(voxels[0, 0] / max(1, widest), "spike bin 0"),
            ),
            checks={
                "counts_valid": (
                    bool(ok),
                    {"shape": str(voxels.shape), "max": int(voxels.max()), "max_allowed": widest},
                )
            },
        )

    return materialize_partitions(context, one)


@partitioned_asset(
    partitions_def=spike_sequences,
    group="spike",
    code_version=VERSIONS[FRAMES_ASSET],
    checks=("frames_aligned",),
    deps=(spike_raw_sequence,),
)
def spike_frames(
    context: dg.AssetExecutionContext,
    raw: RawFolderResource,
    zarr_store: ZarrStoreResource,
    build: BuildOptions,
) -> dg.MaterializeResult:
    """uint8 (samples, H, W, 3) blur and sharp frames, sample-aligned with the spike voxels."""
    store, found = zarr_store.store(), raw.spike_sequences()

    def one(key: str) -> Built:
        seq = _sequence(raw, found, key)
        samples = seq.samples()
        sha = folder_sha256(seq)
        params = {"samples": samples}
        fp = fingerprint(VERSIONS[FRAMES_ASSET], params, {"source_sha256": sha})
        seconds = None
        if not reuse(store, FRAMES_ASSET, key, fp, build.force):
            t0 = time.perf_counter()
            attrs = provenance(str(seq.folder), sha, VERSIONS[FRAMES_ASSET], params, fingerprint=fp)
            with store.write_partition(FRAMES_ASSET, key, attrs) as w:
                for kind in ("blur", "sharp"):
                    shape = (len(samples), seq.height, seq.width, 3)
                    arr = w.create(
                        kind,
                        shape,
                        np.uint8,
                        chunks=(1, *shape[1:]),
                        dimension_names=("sample", "y", "x", "c"),
                    )
                    for i, stem in enumerate(samples):
                        path = seq.folder / kind / f"{stem}.png"
                        img = read_image(path)
                        if img.shape != shape[1:] or img.dtype != np.uint8:
                            raise InputError(
                                path,
                                f"uint8 {shape[1:]} (dataset.json)",
                                f"{img.dtype} {img.shape}",
                            )
                        arr[i] = img
            seconds = time.perf_counter() - t0
        group = store.open_partition(FRAMES_ASSET, key)
        shapes = {kind: group[kind].shape for kind in ("blur", "sharp")}
        want = (len(samples), seq.height, seq.width, 3)
        return Built(
            metadata=report(
                store,
                FRAMES_ASSET,
                key,
                seconds,
                samples=len(samples),
                preview=preview(group["blur"][0], "blur frame 0"),
            ),
            checks={
                "frames_aligned": (
                    all(s == want for s in shapes.values()),
                    {k: str(s) for k, s in shapes.items()},
                )
            },
        )

    return materialize_partitions(context, one)
