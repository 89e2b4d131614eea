"""Transform kernels vs the naive versions described in the seed documents, side by side.

Run: ``.venv/bin/python benchmarks/transforms.py [--quick]``.  Prints ``BENCH`` lines.
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _bench import bench, best_of, ratio

from zarrfeed.transforms import ct, defects, patches, sparse, spike


def sparse_vs_argwhere(edge: int) -> None:
    """Seed 000: ``np.argwhere`` on a 512³ occupancy of 2 % dominated loading."""
    mask = np.random.default_rng(0).random((edge,) * 3, dtype=np.float32) < 0.02
    ours = best_of(lambda: sparse.coords_from_mask(mask))
    base = best_of(lambda: np.argwhere(mask))
    assert np.array_equal(sparse.coords_from_mask(mask), np.argwhere(mask))
    out = sparse.coords_from_mask(mask)
    ratio("transforms.sparse_vs_argwhere", ours, base,
          f"{edge}^3 at 2% occupancy; uint16 {out.nbytes / 1e6:.0f}MB vs int64 "
          f"{np.argwhere(mask).nbytes / 1e6:.0f}MB")  # fmt: skip


def window_vs_float64(shape: tuple[int, int, int]) -> None:
    """Seed 003: whole-volume float64 numpy windowing, then a float16 cast."""
    hu = np.random.default_rng(1).integers(-1024, 2000, size=shape).astype(np.int16)
    w = ct.WINDOWS["lung"]

    def naive():
        return np.clip((hu.astype(np.float64) - w.lo) / w.width, 0, 1).astype(np.float16)

    ours = best_of(lambda: ct.apply_window(hu, "lung"))
    base = best_of(naive)
    err = np.abs(ct.apply_window(hu, "lung").astype(np.float32) - naive().astype(np.float32)).max()
    ratio(
        "transforms.window_vs_float64", ours, base, f"{shape} int16 -> float16, max diff {err:.1e}"
    )


def patch_index_memory(images: int) -> None:
    """Seed 002: one dict per patch (img_idx, img_path, y, x) for 976×176 images, 128/112."""
    shape, patch, stride = (976, 176), 128, 112
    grid = patches.PatchGrid.make(shape, patch, stride)
    paths = [f"/data/inspection/train/stripe_dataset/images/{i:06d}.png" for i in range(images)]

    def dicts():
        out = []
        for i, p in enumerate(paths):
            for y, x in grid.origins().tolist():
                out.append({"img_idx": i, "img_path": p, "y": y, "x": x})
        return out

    def measure(fn):
        tracemalloc.start()
        obj = fn()
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return obj, size

    def stored(keep: slice = slice(None)):
        """What the image patch stage stores and training reads: an item and an origin
        per kept patch, as two compact arrays (``items`` uint32, ``origins`` uint16)."""
        origins = grid.origins().astype(np.uint16)
        items = np.repeat(np.arange(images, dtype=np.uint32), len(grid))
        return items[keep].copy(), np.tile(origins, (images, 1))[keep].copy()

    listed, list_bytes = measure(dicts)
    index, index_bytes = measure(stored)
    assert len(listed) == len(index[0])
    filtered, filtered_bytes = measure(lambda: stored(slice(0, None, 2)))
    bench("transforms.patch_index_memory_ratio", list_bytes / index_bytes, "x",
          f"{images} images, {len(listed)} patches: dicts={list_bytes / 1e6:.1f}MB "
          f"zarrfeed={index_bytes / 1e3:.0f}kB; half filtered out: {filtered_bytes / 1e3:.0f}kB "
          f"({list_bytes / filtered_bytes:.0f}x)")  # fmt: skip
    ours = best_of(stored)
    base = best_of(dicts, repeat=1)
    ratio("transforms.patch_index_build_vs_dicts", ours, base, f"{images} images")
    del listed, filtered


def spike_bins_vs_loop() -> None:
    """Seed 001: 10×396×640 spike frames → 5 bins with a per-bin sum that widens to int64."""
    s = np.random.default_rng(2).integers(0, 2, size=(10, 396, 640), dtype=np.uint8)
    edges = spike.bin_edges(10, 5)

    def naive():
        return np.stack([s[edges[b] : edges[b + 1]].sum(axis=0) for b in range(5)])

    assert np.array_equal(naive(), spike.voxel_bins(s, 5))
    ratio("transforms.spike_bins_vs_loop", best_of(lambda: spike.voxel_bins(s, 5), 20),
          best_of(naive, 20), "10x396x640 -> 5 bins")  # fmt: skip


def resample_vs_zoom(shape: tuple[int, int, int]) -> None:
    """Seed 003: float64 numpy + ``scipy.ndimage.zoom(order=1)`` to CT-CLIP spacing."""
    try:
        from scipy.ndimage import zoom
    except ImportError:
        print("# scipy not installed: transforms.resample_vs_zoom skipped")
        return
    vol = np.random.default_rng(3).integers(-1024, 2000, size=shape).astype(np.int16)
    spacing, target = (1.0, 0.7, 0.7), ct.CT_CLIP.spacing
    size = ct.resampled_shape(shape, spacing, target)
    factors = [n / m for n, m in zip(size, shape, strict=True)]
    ours = best_of(lambda: ct.resample(vol, spacing, target), 2)
    base = best_of(lambda: zoom(vol.astype(np.float64), factors, order=1), 1)
    ratio("transforms.resample_vs_zoom", ours, base, f"{shape} -> {size}, torch trilinear")


def defects_vs_fullimage(n: int) -> None:
    """Seed 002: full-image meshgrid and exp per 3×3 defect on a 976×176 image."""
    rng = np.random.default_rng(4)
    image = rng.random((976, 176)).astype(np.float32)
    d = defects.random_defects(image.shape, rng, p_defect=1.0)
    yy, xx = np.mgrid[:976, :176]

    def naive():
        out = image.copy()
        for (cy, cx), (sy, sx), a in zip(d.centers, d.sigmas, d.amplitudes, strict=True):
            out += a * np.exp(-((yy - cy) ** 2 / (2 * sy**2) + (xx - cx) ** 2 / (2 * sx**2)))
        return out

    ratio("transforms.defects_vs_fullimage", best_of(lambda: defects.render_defects(image, d), n),
          best_of(naive, n), f"{len(d)} defects on 976x176")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller inputs (smoke run)")
    args = parser.parse_args()
    q = args.quick
    sparse_vs_argwhere(128 if q else 512)
    window_vs_float64((30, 128, 128) if q else (300, 512, 512))
    patch_index_memory(500 if q else 10_000)
    spike_bins_vs_loop()
    resample_vs_zoom((30, 128, 128) if q else (300, 512, 512))
    defects_vs_fullimage(5 if q else 20)


if __name__ == "__main__":
    main()
