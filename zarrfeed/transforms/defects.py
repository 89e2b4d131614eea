"""Local Gaussian defect synthesis: render each defect only inside its support.

The seed's first version built full-image meshgrids (976×176) for a 3×3 defect; here each
defect touches only its kernel's footprint, and kernels are computed once and cached.  On
the host one patch at a time (:func:`render_defects`); on the training device a whole batch
at once (``render_batch`` of the image patches' dataset, from the same draws gathered by
:func:`defect_table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=256)
def gaussian_kernel(size: tuple[int, int], sigma: tuple[float, float]) -> np.ndarray:
    """Read-only float32 Gaussian of ``size`` (odd h, w) with peak 1 at the centre."""
    h, w = size
    if h % 2 == 0 or w % 2 == 0:
        raise ValueError(f"kernel size must be odd, got {size}")
    y = np.arange(h, dtype=np.float32) - h // 2
    x = np.arange(w, dtype=np.float32) - w // 2
    k = np.exp(-(y[:, None] ** 2 / (2 * sigma[0] ** 2) + x[None, :] ** 2 / (2 * sigma[1] ** 2)))
    k = k.astype(np.float32)
    k.setflags(write=False)
    return k


@dataclass(frozen=True)
class Defects:
    """A batch of defects as parallel arrays (no per-defect objects)."""

    centers: np.ndarray  # (n, 2) int: row, column
    sizes: np.ndarray  # (n, 2) int, odd
    sigmas: np.ndarray  # (n, 2) float
    amplitudes: np.ndarray  # (n,) float: added intensity at the centre
    in_mask: np.ndarray  # (n,) bool: part of the ground-truth mask

    def __len__(self) -> int:
        return len(self.amplitudes)

    def select(self, keep: np.ndarray) -> Defects:
        """The defects where ``keep`` (a boolean mask) is true."""
        return Defects(
            self.centers[keep],
            self.sizes[keep],
            self.sigmas[keep],
            self.amplitudes[keep],
            self.in_mask[keep],
        )


def random_defects(
    shape: tuple[int, int],
    rng: np.random.Generator,
    p_defect: float = 0.5,
    count: tuple[int, int] = (3, 8),
    mask_count: tuple[int, int] = (0, 2),
    kinds: tuple[tuple[tuple[int, int], tuple[float, float]], ...] = (
        ((3, 3), (1.0, 1.0)),
        ((3, 5), (1.0, 1.5)),
    ),
    amplitude: tuple[float, float] = (0.15, 0.5),
) -> Defects:
    """The defect-detection recipe: half the patches get 3–8 defects, of which 0–2 enter the
    mask."""
    n = int(rng.integers(count[0], count[1] + 1)) if rng.random() < p_defect else 0
    kind = rng.integers(0, len(kinds), size=n)
    sizes = np.array([kinds[k][0] for k in kind], dtype=np.int64).reshape(n, 2)
    sigmas = np.array([kinds[k][1] for k in kind], dtype=np.float64).reshape(n, 2)
    centers = np.stack([rng.integers(0, shape[0], n), rng.integers(0, shape[1], n)], axis=1)
    signs = rng.choice([-1.0, 1.0], size=n)
    amplitudes = signs * rng.uniform(*amplitude, size=n)
    n_mask = min(n, int(rng.integers(mask_count[0], mask_count[1] + 1))) if n else 0
    in_mask = np.zeros(n, dtype=bool)
    in_mask[rng.choice(n, size=n_mask, replace=False)] = True
    return Defects(centers.reshape(n, 2), sizes, sigmas, amplitudes, in_mask)


def render_defects(
    image: np.ndarray,
    defects: Defects,
    mask_level: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Add ``defects`` to a 2-D ``image``; return (float32 image, uint8 ground-truth mask).

    The mask marks pixels where a masked defect's kernel is ≥ ``mask_level`` of its peak.
    """
    out = np.array(image, dtype=np.float32, copy=True)
    mask = np.zeros(out.shape, dtype=np.uint8)
    h, w = out.shape
    for i in range(len(defects)):
        size = (int(defects.sizes[i, 0]), int(defects.sizes[i, 1]))
        kernel = gaussian_kernel(size, (float(defects.sigmas[i, 0]), float(defects.sigmas[i, 1])))
        cy, cx = (int(c) for c in defects.centers[i])
        y0, x0 = cy - size[0] // 2, cx - size[1] // 2
        ys, xs = slice(max(y0, 0), min(y0 + size[0], h)), slice(max(x0, 0), min(x0 + size[1], w))
        if ys.start >= ys.stop or xs.start >= xs.stop:
            continue
        k = kernel[ys.start - y0 : ys.stop - y0, xs.start - x0 : xs.stop - x0]
        out[ys, xs] += np.float32(defects.amplitudes[i]) * k
        if defects.in_mask[i]:
            mask[ys, xs] |= k >= mask_level
    return out, mask


def defect_table(found: list[Defects]) -> dict[str, np.ndarray]:
    """The defects of a batch's samples (``found[b]`` for row ``b``) as flat arrays for
    a batched renderer: each defect's row, centre, size, float32 amplitude, mask flag and
    its kernel, zero-padded to the batch's largest."""
    sizes = np.concatenate([f.sizes for f in found]).reshape(-1, 2).astype(np.int64)
    high, wide = (int(v) for v in sizes.max(axis=0)) if len(sizes) else (1, 1)
    kernels = np.zeros((len(sizes), high, wide), np.float32)
    sigmas = np.concatenate([f.sigmas for f in found]).reshape(-1, 2)
    for i, ((h, w), (sy, sx)) in enumerate(zip(sizes.tolist(), sigmas.tolist(), strict=True)):
        kernels[i, :h, :w] = gaussian_kernel((h, w), (sy, sx))
    return {
        "defect_rows": np.repeat(np.arange(len(found)), [len(f) for f in found]).astype(np.int64),
        "defect_centers": np.concatenate([f.centers for f in found])
        .reshape(-1, 2)
        .astype(np.int64),
        "defect_sizes": sizes,
        "defect_amplitudes": np.concatenate([f.amplitudes for f in found]).astype(np.float32),
        "defect_in_mask": np.concatenate([f.in_mask for f in found]).astype(bool),
        "defect_kernels": kernels,
    }
