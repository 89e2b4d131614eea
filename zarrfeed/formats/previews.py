"""Labelled preview images of stored arrays (PNG bytes; Pillow only, no Dagster).

The asset metadata shows them in the UI and ``zarrfeed inspect`` writes them to files, so a
person sees the same picture in both places: a volume as three orthogonal slices through its
body in radiological display with each edge's orientation letter, one row per window, each
row and column named.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

VIEWS = ("axial", "coronal", "sagittal")
CELL = 256  # pixels a view takes at least on its longer side
FONT = ImageFont.load_default(size=14)
LABEL_H = 18  # pixels of a text line in FONT
EDGE = 16  # margin around a view that holds its orientation letters
OPPOSITE = {"R": "L", "L": "R", "A": "P", "P": "A", "S": "I", "I": "S"}
DISPLAY_AXES = ("SI", "AP", "RL")
# Radiological display: axial and coronal views face the patient (their right on the image's
# left), the sagittal view looks at the patient's left side.  view -> (the anatomical axis it
# cuts, the letter at the top of the image, the letter on its left).
DISPLAY = {"axial": ("SI", "A", "R"), "coronal": ("AP", "S", "R"), "sagittal": ("RL", "S", "A")}


@dataclass(frozen=True)
class View:
    """One displayed slice: the image as drawn, where it cuts, its edges' letters and
    pixel spacing."""

    image: np.ndarray
    cut: str  # "x 171/460": the volume axis cut, the index and the axis length
    edges: tuple[str, str, str, str]  # top, bottom, left, right
    spacing: tuple[float, float]  # mm between rows, between columns


def to_uint8(image: np.ndarray) -> np.ndarray:
    """A 2-D (or H×W×C) array in [0, 1], or uint8/uint16, as uint8."""
    if image.dtype == np.uint8:
        return image
    if image.dtype == np.uint16:
        return (image // 257).astype(np.uint8)
    return (np.clip(np.nan_to_num(image.astype(np.float32)), 0, 1) * 255).astype(np.uint8)


def busiest_slice(volume: np.ndarray, axis: int) -> int:
    """The index along ``axis`` of the slice with the most detail (summed differences
    between neighbouring voxels) in the middle half of the volume: the middle sagittal
    slice of a chest cuts the mediastinum, a uniform block, where one a little to the side
    shows lung vessels, heart and ribs.  Judged on every second voxel of each slice, so it
    costs a small part of reading the volume."""
    n = volume.shape[axis]
    lo, hi = n // 4, max(n // 4 + 1, (3 * n) // 4)
    index: list[slice] = [slice(None, None, 2)] * 3
    index[axis] = slice(lo, hi)
    sample = np.moveaxis(volume[tuple(index)], axis, 0).astype(np.float32)
    detail = np.abs(np.diff(sample, axis=1)).sum(axis=(1, 2))
    detail += np.abs(np.diff(sample, axis=2)).sum(axis=(1, 2))
    return lo + int(np.argmax(detail)) if detail.size else n // 2


def oriented_views(
    volume: np.ndarray,
    axes: str = "SAR",
    spacing_zyx: Sequence[float] | None = None,
    at: Sequence[int] | None = None,
) -> list[View]:
    """The axial, coronal and sagittal slices of a (z, y, x) volume through the voxel
    ``at`` (default: each view's :func:`busiest_slice`), whose indices grow towards
    ``axes`` (``"SAR"``: z superior, y anterior, x to the patient's right), turned and
    flipped for radiological display."""
    pairs = {code: next(p for p in DISPLAY_AXES if code in p) for code in OPPOSITE}
    if len(axes) != 3 or sorted(pairs[c] for c in axes) != sorted(DISPLAY_AXES):
        raise ValueError(f"axes {axes!r}: expected one of R/L, A/P and S/I each, like 'SAR'")
    where = {pairs[code]: (i, code) for i, code in enumerate(axes)}
    spacing = tuple(spacing_zyx or (1.0, 1.0, 1.0))
    views = []
    for name in VIEWS:
        cut, top, left = DISPLAY[name]
        (c, _), (r, r_code), (k, k_code) = where[cut], where[pairs[top]], where[pairs[left]]
        index: list[Any] = [slice(None)] * 3
        index[c] = at[c] if at is not None else busiest_slice(volume, c)
        image = volume[tuple(index)]
        if r > k:  # the remaining axes come in index order: make rows the top letter's
            image = image.T
        if r_code == top:  # indices grow towards the top letter: the first row is its opposite
            image = image[::-1]
        if k_code == left:
            image = image[:, ::-1]
        edges = (top, OPPOSITE[top], left, OPPOSITE[left])
        cut_at = f"{'zyx'[c]} {index[c]}/{volume.shape[c]}"
        views.append(View(image, cut_at, edges, (spacing[r], spacing[k])))
    return views


def fit(image: np.ndarray, size: int, aspect: float = 1.0) -> Image.Image:
    """``image`` scaled to fit a ``size`` square; ``aspect`` stretches rows (a z spacing
    larger than the in-plane one makes coronal and sagittal slices taller)."""
    pil = Image.fromarray(to_uint8(image))
    h, w = pil.height * aspect, pil.width
    scale = size / max(h, w)
    return pil.resize(
        (max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BILINEAR
    )


def grid_png(
    rows: Mapping[str, Sequence[np.ndarray]],
    columns: Sequence[str],
    title: str,
    cell: int = CELL,
    aspects: Sequence[float] | None = None,
    edges: Sequence[Sequence[str]] | None = None,
) -> bytes:
    """Images in a grid: one row per entry of ``rows`` (its name on the left), one column
    per entry of ``columns`` (named on top), ``title`` above all; ``edges`` gives each
    column's orientation letters (top, bottom, left, right), drawn beside its images."""
    aspects = aspects or [1.0] * len(columns)
    pad = EDGE if edges else 2
    box = cell + 2 * pad  # one image and its margin
    left = 8 + int(max(FONT.getlength(name) for name in rows))
    width = left + len(columns) * box + 4
    top0 = 2 * LABEL_H + 8
    height = top0 + len(rows) * box
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 2), title, fill="black", font=FONT)
    for c, name in enumerate(columns):
        draw.text((left + c * box + pad, LABEL_H + 4), name, fill=(60, 60, 60), font=FONT)
    for r, (name, images) in enumerate(rows.items()):
        top = top0 + r * box
        draw.text((4, top + box // 2 - LABEL_H // 2), name, fill="black", font=FONT)
        for c, image in enumerate(images):
            tile = fit(image, cell, aspects[c])
            x0, y0 = left + c * box + pad, top + pad
            x, y = x0 + (cell - tile.width) // 2, y0 + (cell - tile.height) // 2
            canvas.paste(tile.convert("RGB"), (x, y))
            if edges:
                t, b, lt, rt = edges[c]
                mid_x, mid_y = x + tile.width // 2, y + tile.height // 2
                ink = {"fill": (200, 0, 0), "font": FONT, "anchor": "mm"}
                draw.text((mid_x, y - pad // 2), t, **ink)
                draw.text((mid_x, y + tile.height + pad // 2), b, **ink)
                draw.text((x - pad // 2, mid_y), lt, **ink)
                draw.text((x + tile.width + pad // 2, mid_y), rt, **ink)
    return png_bytes(canvas)


def image_png(image: np.ndarray, title: str, max_side: int = 384) -> bytes:
    """One 2-D or H×W×C image under its ``title``."""
    tile = fit(image, max_side)
    width = max(tile.width, int(FONT.getlength(title)) + 8)
    canvas = Image.new("RGB", (width, tile.height + LABEL_H + 6), "white")
    ImageDraw.Draw(canvas).text((4, 2), title, fill="black", font=FONT)
    canvas.paste(tile.convert("RGB"), (0, LABEL_H + 6))
    return png_bytes(canvas)


def volume_png(
    volumes: Mapping[str, np.ndarray],
    title: str,
    spacing_zyx: Sequence[float] | None = None,
    view: Callable[[np.ndarray], np.ndarray] | None = None,
    axes: str = "SAR",
) -> bytes:
    """Each named (z, y, x) volume as a row of its axial, coronal and sagittal middle
    slices in radiological display, each edge lettered from ``axes`` (see
    :func:`oriented_views`); ``view`` (a CT window, say) is applied to those slices only,
    never to a whole volume."""
    view = view or (lambda s: s)
    first = next(iter(volumes.values()))
    at = [busiest_slice(first, axis) for axis in range(3)]  # the same cut in every row
    rows, shown = {}, []
    for name, volume in volumes.items():
        shown = oriented_views(volume, axes, spacing_zyx, at)
        rows[name] = [view(v.image) for v in shown]
    columns = [f"{name} ({v.cut})" for name, v in zip(VIEWS, shown, strict=True)]
    aspects = [v.spacing[0] / v.spacing[1] for v in shown]
    return grid_png(rows, columns, title, aspects=aspects, edges=[v.edges for v in shown])


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    # zlib level 3: on CT previews both faster and smaller than the default 6 (three windows
    # of a 240×480×480 scan: 0.25 s and 361 KB against 0.31 s and 434 KB); optimize=True
    # (level 9 and a second pass) costs several times the time for a few per cent.
    image.save(buf, format="PNG", compress_level=3)
    return buf.getvalue()
