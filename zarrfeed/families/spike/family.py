"""The spike family: a raw sequence folder → spike voxel bins, and the blur/sharp frames.

One partition per sequence; arrays are (samples, …) so a training clip is a slice.  Both
stages read the raw sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from zarrfeed.errors import InputError
from zarrfeed.families.facts import Picture
from zarrfeed.families.family import Family, RawSource, Reader, Stage
from zarrfeed.families.spike.discover import (
    SpikeSequence,
    scan_spike,
    spike_datasets,
    spike_sequence,
)
from zarrfeed.families.stages import Checks, Inputs, Step
from zarrfeed.formats import read_dat, read_image
from zarrfeed.formats.limits import GIB, Bound, claimed_bytes, require_allocatable
from zarrfeed.formats.previews import grid_png
from zarrfeed.sources.catalog import RawItem
from zarrfeed.store.contract import ArraySpec, Check, StoredAsset
from zarrfeed.transforms import spike as sp
from zarrfeed.transforms.augment.ops import Flip, Rot90

FRAME_KINDS = ("blur", "sharp")  # the frame folders of a sequence, and their arrays
# A GoPro-spike sample is 360×640 × 137 frames (32 MB decoded), a SpikeZoo one 250×400 × 301
# (30 MB); 4 GiB holds 800 samples of 5 bins at 1000×1000.
BOUND = Bound("spike", 4 * GIB)  # the most one sequence's arrays may take


class SpikeSettings(BaseModel):
    """Spike voxelisation: camera frames per sample are summed into ``bins`` count images."""

    model_config = ConfigDict(extra="forbid")

    bins: int = Field(5, ge=1, description="10 high-speed frames → 5 bins")


SPIKE_VOXELS = StoredAsset(
    name="spike_voxels",
    path="spike/voxels",
    family="spike",
    version="1",
    arrays=(ArraySpec("voxels", ("sample", "bin", "y", "x"), "uint8", "sample", "events"),),
    description="uint8 (samples, bins, H, W) spike counts: each sample's camera frames "
    "summed per bin.",
    params=("bins",),
    per_dataset=("bins",),  # the deblurring model's input channels and voxel scale
    checks=(Check("counts_valid", "Spike counts per bin never exceed the frames the bin sums."),),
)
SPIKE_FRAMES = StoredAsset(
    name="spike_frames",
    path="spike/frames",
    family="spike",
    version="1",
    arrays=tuple(ArraySpec(k, ("sample", "y", "x", "c"), "uint8", "sample") for k in FRAME_KINDS),
    description="uint8 (samples, H, W, 3) blurred and sharp frames, sample-aligned with the "
    "spike voxels.",
    checks=(
        Check(
            "frames_aligned",
            "Blurred and sharp frames have one entry per sample and the camera's frame size.",
        ),
    ),
)


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
    inputs: Inputs,
    key: str,
    produce: Callable[[SpikeSequence, list[str]], dict[str, np.ndarray]],
    check: Callable[[SpikeSequence, list[str], dict[str, np.ndarray]], Checks],
    describe: Callable[[dict[str, np.ndarray]], dict[str, Any]],
) -> Step:
    item, sha, identity = inputs.source(key)
    seq = spike_sequence(item)
    watch = inputs.watch(item)  # before the listing: a sample added after it shows
    samples = seq.samples()
    if not samples:
        raise InputError(seq.folder, f"samples in {seq.spike_folder}/, blur/ and sharp/", "none")
    return Step(
        inputs=identity,
        source=item.location,
        source_sha256=sha,
        produce=lambda: produce(seq, samples),
        check=lambda arrays: check(seq, samples, arrays),
        describe=describe,
        attrs={
            "source_stamp": item.stamp,
            "links": inputs.links(item),  # link → target, its hash (ZARRFEED_RAW_LINKS)
            "samples": samples,
            "layout": seq.layout,
            "frames": seq.frames,
            "spike_folder": seq.spike_folder,
        },
        watch=watch,
    )


def voxels_step(inputs: Inputs, key: str) -> Step:
    bins = inputs.settings["bins"]

    def produce(seq: SpikeSequence, samples: list[str]) -> dict[str, np.ndarray]:
        shape = (len(samples), bins, seq.height, seq.width)
        what = f"{'×'.join(map(str, shape))} uint8 voxel bins"
        require_allocatable(seq.folder, claimed_bytes(shape, 1), what, BOUND)
        out = np.empty(shape, np.uint8)
        for i, stem in enumerate(samples):
            path = seq.folder / seq.spike_folder / f"{stem}.dat"
            out[i] = sp.voxel_bins(
                read_dat(path, seq.height, seq.width, seq.layout, seq.frames), bins
            )
        return {"voxels": out}

    def check(seq: SpikeSequence, samples: list[str], arrays: dict) -> Checks:
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
        return {"samples": len(voxels), "preview": Picture(bins_png, title)}

    return _sequence_step(inputs, key, produce, check, describe)


def _frames(seq: SpikeSequence, samples: list[str]) -> dict[str, np.ndarray]:
    out = {}
    for kind in FRAME_KINDS:
        shape = (len(samples), seq.height, seq.width, 3)
        what = f"{'×'.join(map(str, shape))} uint8 {kind} frames"
        require_allocatable(seq.folder, claimed_bytes(shape, 1), what, BOUND)
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


def _frames_check(seq: SpikeSequence, samples: list[str], arrays: dict) -> Checks:
    want = (len(samples), seq.height, seq.width, 3)
    shapes = {k: a.shape for k, a in arrays.items()}
    return {
        "frames_aligned": (
            all(s == want for s in shapes.values()),
            {k: str(s) for k, s in shapes.items()},
        )
    }


def _frames_preview(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    png = grid_png({"sample 0": [arrays[k][0] for k in FRAME_KINDS]}, list(FRAME_KINDS), "frames")
    return {"preview": Picture(png, "sample 0: blurred and sharp frame")}


def frames_step(inputs: Inputs, key: str) -> Step:
    return _sequence_step(inputs, key, _frames, _frames_check, _frames_preview)


def sequence_files(item: RawItem) -> list[Path]:
    return spike_sequence(item).files()


# Spike clips: blur and sharp frames (N, L, 3, H, W), voxels (N, L, bins, H, W), all moved
# alike in their last two axes; no intensity operation (the sharp frames are the blurred
# ones' target, the voxels spike counts).
RECIPE = "spike"  # its augmentation recipe: what its tasks augment with by default
AUGMENT: dict[str, Any] = {
    "keys": {"blur": "target", "sharp": "target", "voxels": "target"},
    "spatial_dims": 2,
    "flip": Flip(p=0.5, axes=(0, 1)),
    "rot90": Rot90(p=0.5, axes=(0, 1)),
}

SPIKE = Family(
    name="spike",
    partitions="spike_sequences",
    raw=RawSource(
        asset="spike_raw_sequence",
        items="spike sequences",
        description="A raw spike sequence folder: one hash over its files (the data version) "
        "and layout.",
        kinds=frozenset({"numpy"}),
        scan=scan_spike,
        files=sequence_files,
        describe=describe_sequence,
        readable=Check("readable", "Every sample has its spike stream, blurred and sharp frame."),
        version="2",
        claims=spike_datasets,
    ),
    settings=SpikeSettings,
    stages=(Stage(SPIKE_VOXELS, voxels_step), Stage(SPIKE_FRAMES, frames_step)),
    dataset_version="2",
    readers=(Reader("spike", "zarrfeed.families.spike.datasets:SpikeClipDataset"),),
    tasks=("zarrfeed.families.spike.tasks:SpikeDeblurring",),
    augment={RECIPE: AUGMENT},
)
