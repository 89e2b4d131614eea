"""2-D images: PNG/JPEG through Pillow, TIFF (any dtype, any channels) through tifffile.

Pixels come back as the file holds them and as a viewer shows them: a 16-bit colour PNG
(RGB, RGBA, grey with alpha), which Pillow's modes can only give as 8 bits per channel, is
decoded (and written) by pypng and returned as uint16, never shifted down to uint8, its
samples as stored (no sBIT rescaling; a tRNS colour, as in Pillow's RGB, adds no alpha); an
EXIF orientation tag (a phone's JPEG, 2–8) is applied as :func:`PIL.ImageOps.exif_transpose`
applies it, and :func:`image_orientation` tells it, for the provenance.

No image may have more pixels than Pillow's decompression-bomb limit
(``PIL.Image.MAX_IMAGE_PIXELS``, about 89 million; raise it process-wide for larger real
images), and an uncompressed TIFF must hold the bytes its tags claim: both are checked from
the header, before the pixels are decoded.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import png
import tifffile
from PIL import Image, ImageOps, UnidentifiedImageError

from zarrfeed.errors import InputError
from zarrfeed.formats.limits import claimed_bytes, require_bytes

TIFF_SUFFIXES = {".tif", ".tiff"}
EXIF_ORIENTATION = 0x0112
# Pillow's modes of the PNGs whose 16-bit samples it shifts down to 8 bits (16-bit grey is
# I;16, kept exactly): these are read through pypng when the header says 16 bits.
PNG16_MODES = ("LA", "RGB", "RGBA")


def _require_pixels(path: Path, pixels: int, shape: tuple[int, ...]) -> None:
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and pixels > limit:
        raise InputError(
            path, f"at most {limit} pixels (PIL.Image.MAX_IMAGE_PIXELS)", f"shape {shape}"
        )


def _read_tiff(path: Path) -> np.ndarray:
    """The first series as (H, W) or (H, W, C): a planar TIFF (one plane per channel, axes
    ``SYX``) has its channels moved last; more than one page or plane of anything else (a
    stack, a time series) is refused, not read as an image with pages for rows."""
    with tifffile.TiffFile(path) as tif:
        series = tif.series[0]
        shape, dtype, axes = tuple(series.shape), np.dtype(series.dtype), series.axes
        pixels = math.prod(n for n, a in zip(shape, axes, strict=True) if a != "S")
        _require_pixels(path, pixels, shape)
        # Axes of length 1 (one page, one sample) say nothing; what is left must be Y, X and
        # at most one channel axis (S: samples of a pixel, C: channels of an ImageJ file).
        kept = [(n, a) for n, a in zip(shape, axes, strict=True) if n > 1 or a in "YX"]
        channels = [a for _, a in kept if a in "SC"]
        if {a for _, a in kept} - set("YXSC") or len(channels) > 1 or "YX" not in axes:
            raise InputError(
                path, "one 2-D image (axes Y, X and samples)", f"axes {axes} of shape {shape}"
            )
        if all(page.compression == 1 for page in series.pages):
            require_bytes(
                path, claimed_bytes(shape, dtype.itemsize), path.stat().st_size,
                f"an uncompressed {shape} {dtype} image",
            )  # fmt: skip
        image = series.asarray().reshape([n for n, _ in kept])
    order = [a for _, a in kept]
    source = [order.index(a) for a in "YX" + "".join(channels)]
    return np.ascontiguousarray(np.moveaxis(image, source, range(len(order))))


def _shown(im: Image.Image) -> Image.Image:
    """The pixels an image shows: a palette image's colours (grey when every palette entry
    is grey, with alpha when it has transparency), a bilevel image as 0/255 grey."""
    if im.mode in ("P", "PA"):
        alpha = im.mode == "PA" or "transparency" in im.info
        colours = np.asarray(im.getpalette("RGB") or [], dtype=np.uint8).reshape(-1, 3)
        grey = bool((colours == colours[:, :1]).all())
        return im.convert(("LA" if alpha else "L") if grey else ("RGBA" if alpha else "RGB"))
    return im.convert("L") if im.mode == "1" else im


def _png16(path: Path) -> np.ndarray | None:
    """A 16-bit colour PNG (grey-alpha, RGB, RGBA) as (H, W, C) uint16, its samples as
    stored (pypng's ``read``: no palette, no tRNS or sBIT applied); None when the header
    says 8 bits (then Pillow reads it exactly)."""
    with path.open("rb") as file:  # pypng's Reader(filename=) never closes the file it opens
        width, height, rows, info = png.Reader(file=file).read()
        if info["bitdepth"] != 16:
            return None
        image = np.vstack([np.frombuffer(row, np.uint16) for row in rows])  # rows read lazily
    return image.reshape(height, width, info["planes"])


def _orient(image: np.ndarray, orientation: int | None) -> np.ndarray:
    """``image`` as an EXIF ``orientation`` (1–8) says a viewer shows it: the transposition
    :func:`PIL.ImageOps.exif_transpose` makes, for arrays of any dtype."""
    turn = {
        2: lambda a: a[:, ::-1],  # flip left-right
        3: lambda a: a[::-1, ::-1],  # rotate 180°
        4: lambda a: a[::-1],  # flip top-bottom
        5: lambda a: np.swapaxes(a, 0, 1),  # transpose
        6: lambda a: np.rot90(a, -1),  # rotate 90° clockwise
        7: lambda a: np.swapaxes(a, 0, 1)[::-1, ::-1],  # transverse
        8: lambda a: np.rot90(a, 1),  # rotate 90° counter-clockwise
    }.get(orientation or 1)
    return image if turn is None else np.ascontiguousarray(turn(image))


def _orientation_tag(im: Image.Image) -> int | None:
    """The EXIF orientation of an open image, from its header: a PNG's ``eXIf`` chunk counts
    where it precedes the pixels, as the PNG specification places it (Pillow would decode
    the whole image to look for one after them)."""
    if im.format == "PNG" and "exif" not in im.info:
        return None
    value = im.getexif().get(EXIF_ORIENTATION)
    return int(value) if isinstance(value, int) and 1 <= value <= 8 else None


def image_orientation(path: str | Path) -> int | None:
    """The EXIF orientation tag of a PNG or JPEG (1–8; None when it has none, or is a TIFF,
    whose pixels are read as stored), read from the header without decoding the pixels."""
    path = Path(path)
    if path.suffix.lower() in TIFF_SUFFIXES:
        return None
    try:
        with Image.open(path) as im:
            return _orientation_tag(im)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise InputError(path, "a PNG, JPEG or TIFF image", f"an unreadable file ({exc})") from exc


def read_image(path: str | Path) -> np.ndarray:
    """(H, W) or (H, W, C) array with the file's own dtype (:func:`_shown`: the colours of a
    palette image, not its indices; 16-bit colour PNGs as uint16), turned as its EXIF
    orientation says (:func:`image_orientation`)."""
    path = Path(path)
    try:
        if path.suffix.lower() in TIFF_SUFFIXES:
            return _read_tiff(path)
        # The limit is checked here from the header, not by turning Pillow's warning into an
        # error: warning filters are process-wide, and partitions are read side by side.
        with Image.open(path) as im:
            width, height = im.size
            _require_pixels(path, width * height, (height, width))
            orientation = _orientation_tag(im)
            deep = _png16(path) if im.format == "PNG" and im.mode in PNG16_MODES else None
            if deep is not None:
                return _orient(deep, orientation)
            if orientation not in (None, 1):
                return np.asarray(_shown(ImageOps.exif_transpose(im)))
            return np.asarray(_shown(im))
    except InputError:
        raise
    except Image.DecompressionBombError as exc:
        raise InputError(path, "at most PIL.Image.MAX_IMAGE_PIXELS pixels", str(exc)) from exc
    except (
        UnidentifiedImageError, tifffile.TiffFileError, png.Error, OSError, ValueError
    ) as exc:  # fmt: skip
        raise InputError(path, "a PNG, JPEG or TIFF image", f"an unreadable file ({exc})") from exc


def _write_png16(path: Path, array: np.ndarray) -> None:
    """A 16-bit grey-alpha, RGB or RGBA PNG (which Pillow cannot write), through pypng: rows
    handed over packed, as big-endian bytes."""
    height, width, channels = array.shape
    writer = png.Writer(
        width, height, bitdepth=16, greyscale=channels == 2, alpha=channels in (2, 4)
    )
    rows = np.ascontiguousarray(array.astype(">u2")).view(np.uint8).reshape(height, -1)
    with path.open("wb") as out:
        writer.write_packed(out, rows)


def write_image(path: str | Path, array: np.ndarray) -> None:
    """Write PNG (uint8/uint16, grey or colour) or TIFF (any dtype) by suffix,
    deterministically."""
    path = Path(path)
    if path.suffix.lower() in TIFF_SUFFIXES:
        rgb = array.ndim == 3 and array.shape[-1] in (3, 4)
        tifffile.imwrite(path, array, photometric="rgb" if rgb else "minisblack", metadata=None)
    elif array.dtype == np.uint16 and array.ndim == 3 and array.shape[-1] in (2, 3, 4):
        _write_png16(path, array)
    else:
        Image.fromarray(array).save(path, optimize=False)
