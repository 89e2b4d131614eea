"""Labelled preview images of stored arrays (PNG bytes; Pillow only, no Dagster).

The asset metadata shows them in the UI and ``zarrfeed inspect`` writes them to files, so a
person sees the same picture in both places: a volume as its three orthogonal middle slices,
one row per window, each row and column named.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from PIL import Image, ImageDraw

VIEWS = ("axial", "coronal", "sagittal")
LABEL_H = 14  # pixels of a text line in Pillow's default font


def to_uint8(image: np.ndarray) -> np.ndarray:
    """A 2-D (or H×W×C) array in [0, 1], or uint8/uint16, as uint8."""
    if image.dtype == np.uint8:
        return image
    if image.dtype == np.uint16:
        return (image // 257).astype(np.uint8)
    return (np.clip(np.nan_to_num(image.astype(np.float32)), 0, 1) * 255).astype(np.uint8)


def middle_slices(volume: np.ndarray) -> list[np.ndarray]:
    """The axial, coronal and sagittal middle slices of a (z, y, x) volume."""
    z, y, x = (n // 2 for n in volume.shape)
    return [volume[z], volume[:, y], volume[:, :, x]]


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
    cell: int = 128,
    aspects: Sequence[float] | None = None,
) -> bytes:
    """Images in a grid: one row per entry of ``rows`` (its name on the left), one column
    per entry of ``columns`` (named on top), ``title`` above all."""
    aspects = aspects or [1.0] * len(columns)
    left = 8 + max(len(name) for name in rows) * 6
    width = left + len(columns) * (cell + 4) + 4
    height = 2 * LABEL_H + 8 + len(rows) * (cell + 4)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 2), title, fill="black")
    for c, name in enumerate(columns):
        draw.text((left + c * (cell + 4), LABEL_H + 4), name, fill=(60, 60, 60))
    for r, (name, images) in enumerate(rows.items()):
        top = 2 * LABEL_H + 8 + r * (cell + 4)
        draw.text((4, top + cell // 2 - LABEL_H // 2), name, fill="black")
        for c, image in enumerate(images):
            tile = fit(image, cell, aspects[c])
            x = left + c * (cell + 4) + (cell - tile.width) // 2
            canvas.paste(tile.convert("RGB"), (x, top + (cell - tile.height) // 2))
    return png_bytes(canvas)


def image_png(image: np.ndarray, title: str, max_side: int = 384) -> bytes:
    """One 2-D or H×W×C image under its ``title``."""
    tile = fit(image, max_side)
    canvas = Image.new("RGB", (max(tile.width, 6 * len(title) + 8), tile.height + LABEL_H + 6))
    canvas.paste((255, 255, 255), (0, 0, canvas.width, canvas.height))
    ImageDraw.Draw(canvas).text((4, 2), title, fill="black")
    canvas.paste(tile.convert("RGB"), (0, LABEL_H + 6))
    return png_bytes(canvas)


def volume_png(
    volumes: Mapping[str, np.ndarray],
    title: str,
    spacing_zyx: Sequence[float] | None = None,
    view: Callable[[np.ndarray], np.ndarray] | None = None,
) -> bytes:
    """Each named (z, y, x) volume as a row of its three orthogonal middle slices;
    ``view`` (a CT window, say) is applied to those slices only, never to a whole volume."""
    aspect = spacing_zyx[0] / spacing_zyx[1] if spacing_zyx else 1.0
    view = view or (lambda s: s)
    rows = {name: [view(s) for s in middle_slices(v)] for name, v in volumes.items()}
    return grid_png(rows, VIEWS, title, aspects=[1.0, aspect, aspect])


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    # zlib's default level: optimize=True (level 9 and a second pass) costs several times
    # the time for a few per cent of a preview's size.
    image.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()
