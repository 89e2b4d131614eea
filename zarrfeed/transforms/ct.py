"""CT intensity and geometry transforms: windows, resampling, crop/pad, presets.

HU rescaling lives in :mod:`zarrfeed.transforms.hu`.

Arrays are (z, y, x) and spacings are (z, y, x) in millimetres everywhere in zarrfeed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np

from zarrfeed.processes import usable_cpus

Spacing = tuple[float, float, float]


@dataclass(frozen=True)
class Window:
    """A display window: width W and level L in HU; maps [L − W/2, L + W/2] to [0, 1]."""

    width: float
    level: float

    def __post_init__(self) -> None:
        if not self.width > 0:
            raise ValueError(f"window width must be > 0, got {self.width}")

    @property
    def lo(self) -> float:
        return self.level - self.width / 2

    @property
    def hi(self) -> float:
        return self.level + self.width / 2


# Radiopaedia's window presets (width, level) in HU.
WINDOWS: Mapping[str, Window] = {
    "lung": Window(1500, -600),
    "mediastinum": Window(350, 50),
    "abdomen": Window(400, 50),
    "liver": Window(150, 30),
    "bone": Window(1800, 400),
    "brain": Window(80, 40),
    # CT-CLIP's intensity range: [−1000, 1000] HU; its [−1, 1] is 2·window − 1.
    "ct-clip": Window(2000, 0),
}


def get_window(spec: str | Window) -> Window:
    """A preset name (``"lung"``), a custom ``"W/L"`` string (``"400/40"``) or a Window."""
    if isinstance(spec, Window):
        return spec
    if spec in WINDOWS:
        return WINDOWS[spec]
    width, sep, level = spec.partition("/")
    try:
        if sep:
            return Window(float(width), float(level))
    except ValueError:
        pass
    raise ValueError(
        f"unknown window {spec!r}: use one of {sorted(WINDOWS)} or 'W/L' such as '400/40'"
    )


def clip(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return np.clip(x, lo, hi)


def resampled_shape(shape: tuple[int, ...], spacing: Spacing, target: Spacing) -> tuple[int, ...]:
    """CT-CLIP's rule: ``int(n · current / target)`` per axis (at least 1)."""
    return tuple(max(1, int(n * s / t)) for n, s, t in zip(shape, spacing, target, strict=True))


def resample(volume: np.ndarray, spacing: Spacing, target: Spacing) -> np.ndarray:
    """Trilinear resampling to ``target`` spacing (torch, ``align_corners=False``), float32.

    Always a new array, also when the size does not change (then a float32 copy), so that
    callers may work on the result in place."""
    size = resampled_shape(volume.shape, spacing, target)
    if tuple(size) == volume.shape:
        return np.array(volume, dtype=np.float32)
    import torch  # here, not at import: the CLI's commands start without torch (~1.7 s)

    src = torch.from_numpy(np.ascontiguousarray(volume, dtype=np.float32))[None, None]
    with torch.inference_mode():
        out = torch.nn.functional.interpolate(src, size=size, mode="trilinear", align_corners=False)
    return out[0, 0].numpy()


# Output z planes per call when resampling an oblique volume: the temporaries of one call
# stay small, whatever the volume's size.
_ALIGN_SLAB = 16


def align_to_axes(
    volume: np.ndarray, affine: np.ndarray, target: Spacing, fill: float = -1024.0
) -> tuple[np.ndarray, np.ndarray]:
    """Trilinear resampling of a (z, y, x) volume onto an axis-aligned grid, float32.

    ``affine`` maps voxel (x, y, z) of ``volume`` (its indices reversed) to RAS+ millimetres,
    as :attr:`zarrfeed.formats.volume.Volume.affine` does, with any rotation or shear.  The
    new grid has spacing ``target`` (z, y, x) along S, A, R and covers the bounding box of
    the volume's voxel centres: its voxel 0 sits at the box's lowest corner.  Outside the
    volume it is ``fill`` (air).  Returns the volume and the new grid's affine (diagonal).

    Works in slabs of z planes with :func:`scipy.ndimage.affine_transform` straight from the
    float32 input, so the only new full-size array is the result.
    """
    from scipy.ndimage import affine_transform

    affine = np.asarray(affine, dtype=float)
    n_xyz = np.array(volume.shape[::-1], dtype=float)
    corners = np.array(np.meshgrid(*[[0.0, n - 1] for n in n_xyz], indexing="ij"))
    world = affine[:3, :3] @ corners.reshape(3, -1) + affine[:3, 3:]
    lo, hi = world.min(axis=1), world.max(axis=1)
    t_xyz = np.array(target[::-1], dtype=float)
    out_xyz = (np.floor((hi - lo) / t_xyz + 1e-6) + 1).astype(int)
    grid = np.eye(4)
    grid[:3, :3] = np.diag(t_xyz)
    grid[:3, 3] = lo
    # Output voxel (x, y, z) → input voxel (x, y, z); reversed to the arrays' (z, y, x).
    to_input = np.linalg.inv(affine) @ grid
    matrix, offset = to_input[:3, :3][::-1, ::-1], to_input[:3, 3][::-1]
    src = np.ascontiguousarray(volume, dtype=np.float32)
    shape = tuple(int(n) for n in out_xyz[::-1])
    out = np.empty(shape, dtype=np.float32)
    for z0 in range(0, shape[0], _ALIGN_SLAB):
        z1 = min(z0 + _ALIGN_SLAB, shape[0])
        affine_transform(
            src,
            matrix,
            offset=offset + matrix[:, 0] * z0,
            output_shape=(z1 - z0, *shape[1:]),
            output=out[z0:z1],
            order=1,
            mode="constant",
            cval=fill,
            prefilter=False,
        )
    return out, grid


def crop_or_pad(volume: np.ndarray, shape: tuple[int, ...], fill: float) -> np.ndarray:
    """Centre crop and/or symmetric pad to ``shape``; extra pad goes after, extra crop too."""
    if volume.ndim != len(shape):
        raise ValueError(f"volume has {volume.ndim} axes, target shape {shape} has {len(shape)}")
    out = np.full(shape, fill, dtype=volume.dtype)
    src, dst = [], []
    for n, m in zip(volume.shape, shape, strict=True):
        if n >= m:
            start = (n - m) // 2
            src.append(slice(start, start + m))
            dst.append(slice(0, m))
        else:
            start = (m - n) // 2
            src.append(slice(0, n))
            dst.append(slice(start, start + n))
    out[tuple(dst)] = volume[tuple(src)]
    return out


def normalise(x: np.ndarray, lo: float, hi: float, out_lo: float = 0.0, out_hi: float = 1.0):
    """Linear map of [lo, hi] onto [out_lo, out_hi] (no clipping), float32."""
    scale = (out_hi - out_lo) / (hi - lo)
    return (np.asarray(x, dtype=np.float32) - np.float32(lo)) * np.float32(scale) + np.float32(
        out_lo
    )


# Voxels per block: temporaries stay in cache, and the float16 cast stays below torch's
# grain size (32,768 elements), so it runs inline.  One more element and every block opens an
# intra-op parallel region, whose barrier costs 30x the work on a busy machine (measured:
# 1.7 s instead of 0.056 s a window while another process held the other core).
_WINDOW_BLOCK = 1 << 15


def apply_window(
    hu: np.ndarray,
    window: str | Window,
    dtype: Literal["float16", "uint8", "float32"] = "float16",
) -> np.ndarray:
    """Window HU to [0, 1]: ``clip((HU − lo) / W, 0, 1)`` as float16/float32, or ``round(255·y)``.

    Works block by block in float32 (never float64) and casts through torch, which is several
    times faster than numpy's float32 → float16 conversion.
    """
    import torch

    w = get_window(window)
    flat_in = np.ascontiguousarray(hu).reshape(-1)
    out = np.empty(flat_in.shape, dtype=np.dtype(dtype))
    out_t = torch.from_numpy(out)
    buf = np.empty(min(_WINDOW_BLOCK, flat_in.size), dtype=np.float32)
    scale, offset = np.float32(1.0 / w.width), np.float32(-w.lo / w.width)
    if dtype == "uint8":
        scale, offset = scale * np.float32(255), offset * np.float32(255)
        top = np.float32(255)
    else:
        top = np.float32(1)
    for start in range(0, flat_in.size, _WINDOW_BLOCK):
        block = flat_in[start : start + _WINDOW_BLOCK]
        b = buf[: block.size]
        np.multiply(block, scale, out=b, casting="unsafe")
        b += offset
        np.clip(b, 0, top, out=b)
        if dtype == "uint8":
            np.rint(b, out=b)
        out_t[start : start + block.size] = torch.from_numpy(b)
    return out.reshape(np.shape(hu))


def apply_windows(
    hu: np.ndarray,
    windows: Sequence[str],
    dtype: Literal["float16", "uint8", "float32"] = "float16",
) -> dict[str, np.ndarray]:
    """:func:`apply_window` for each named window, side by side in threads (numpy and torch
    release the GIL inside each block), at most one per core."""
    workers = max(1, min(len(windows), usable_cpus()))
    with ThreadPoolExecutor(workers, thread_name_prefix="window") as pool:
        windowed = pool.map(lambda w: apply_window(hu, w, dtype), windows)
        return dict(zip(windows, windowed, strict=True))


@dataclass(frozen=True)
class CTPreset:
    """Resample → clip → normalise → crop/pad, as one named recipe recorded in provenance.

    ``clip_first`` clips before resampling instead (CT-CLIP's order: metal is clipped to the
    top of the range before it is blurred into its neighbours).  ``axes`` names the output's
    axes in terms of the input's (z, y, x): ``"zxy"`` swaps the two in-plane axes after
    resampling; ``shape`` is in the output's axes.
    """

    name: str
    spacing: Spacing
    clip: tuple[float, float]
    out_range: tuple[float, float] | None  # None keeps HU (int16 output)
    shape: tuple[int, int, int] | None
    fill: float
    dtype: str
    clip_first: bool = False
    axes: str = "zyx"

    def __post_init__(self) -> None:
        if sorted(self.axes) != ["x", "y", "z"]:
            raise ValueError(f"axes must order z, y and x, got {self.axes!r}")

    def params(self) -> dict:
        return {
            "preset": self.name,
            "spacing_zyx_mm": list(self.spacing),
            "clip_hu": list(self.clip),
            "clip_first": self.clip_first,
            "out_range": list(self.out_range) if self.out_range else None,
            "axes": self.axes,
            "shape": list(self.shape) if self.shape else None,
            "fill": self.fill,
            "dtype": self.dtype,
        }


# CT-CLIP's preprocessing of CT-RATE (``data_preprocess/`` and
# ``scripts/data_inference_nii.py`` of ibrahimethemhamamci/CT-CLIP): HU clipped to
# [-1000, 1000], trilinear resampling (align_corners=False) to 1.5 × 0.75 × 0.75 mm, /1000,
# centre crop / symmetric pad to 240 × 480 × 480 with -1, float32, axes (z, x, y) of the
# NIfTI's *stored* voxel grid.  CT-CLIP does not reorient: give :func:`preprocess` the HU of
# ``read_nifti(path, canonical=False)`` — whose (z, y, x) are the file's (k, j, i) — or use
# :func:`zarrfeed.formats.ct.ct_clip_input`.  Its result is CT-CLIP's tensor without the
# channel axis: ``(D, H, W) = (k, i, j)``.  The store's ct_hu volumes are (S, A, R) instead,
# and clip only after resampling: a ``ct-clip`` window of them is not this tensor.
CT_CLIP = CTPreset(
    name="ct-clip",
    spacing=(1.5, 0.75, 0.75),
    clip=(-1000.0, 1000.0),
    out_range=(-1.0, 1.0),
    shape=(240, 480, 480),
    fill=-1.0,
    dtype="float32",
    clip_first=True,
    axes="zxy",
)

# HU kept as int16 at CT-CLIP geometry: the source of every window asset.
HU_ISOTROPIC = CTPreset(
    name="hu",
    spacing=(1.5, 0.75, 0.75),
    clip=(-1024.0, 3071.0),
    out_range=None,
    shape=None,
    fill=-1024.0,
    dtype="int16",
)


def preprocess(hu: np.ndarray, spacing: Spacing, preset: CTPreset = CT_CLIP) -> np.ndarray:
    """Apply a preset to an HU volume (z, y, x) with the given spacing (never in place)."""
    lo, hi = preset.clip
    if preset.clip_first:
        hu = np.clip(hu, lo, hi, dtype=np.float32)
    vol = resample(hu, spacing, preset.spacing)
    if not preset.clip_first:
        np.clip(vol, lo, hi, out=vol)
    fill = preset.fill
    if preset.out_range is not None:
        vol = normalise(vol, lo, hi, *preset.out_range)
    if preset.axes != "zyx":
        vol = vol.transpose(tuple("zyx".index(a) for a in preset.axes))
    if preset.shape is not None:
        vol = crop_or_pad(vol, preset.shape, fill)
    vol = np.ascontiguousarray(vol)
    if np.dtype(preset.dtype).kind in "iu":
        np.rint(vol, out=vol)
        return vol.astype(preset.dtype)
    if preset.dtype == "float32":
        return vol.astype(np.float32, copy=False)
    import torch

    return torch.from_numpy(vol).to(getattr(torch, preset.dtype)).numpy()


def sample_resampled(
    source: np.ndarray, out_shape: tuple[int, ...], points: np.ndarray
) -> np.ndarray:
    """Values that :func:`resample` should produce at output voxels ``points`` ((n, 3) ints).

    An independent trilinear evaluation in numpy (``align_corners=False`` geometry: output
    voxel i sits at input coordinate ``(i + 0.5) · n_in / n_out − 0.5``, clamped to the edge),
    used to verify stored volumes against their source on a subsample (``zarrfeed verify``).
    """
    pts = np.asarray(points, dtype=np.float64)
    scale = np.array(source.shape, dtype=np.float64) / np.array(out_shape, dtype=np.float64)
    coord = np.clip((pts + 0.5) * scale - 0.5, 0, np.array(source.shape) - 1)
    lo = np.floor(coord).astype(np.intp)
    hi = np.minimum(lo + 1, np.array(source.shape) - 1)
    frac = coord - lo
    out = np.zeros(len(pts))
    for corner in range(8):
        pick = [(corner >> axis) & 1 for axis in range(3)]
        idx = tuple(np.where(pick[a], hi[:, a], lo[:, a]) for a in range(3))
        weight = np.prod([frac[:, a] if pick[a] else 1 - frac[:, a] for a in range(3)], axis=0)
        out += weight * source[idx]
    return out
