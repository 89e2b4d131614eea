"""2-D images: PNG/JPEG through Pillow, TIFF (any dtype, any channels) through tifffile.

No image may have more pixels than Pillow's decompression-bomb limit
(``PIL.Image.MAX_IMAGE_PIXELS``, about 89 million; raise it process-wide for larger real
images), and an uncompressed TIFF must hold the bytes its tags claim: both are checked from
the header, before the pixels are decoded.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import tifffile
from PIL import Image, UnidentifiedImageError

from zarrfeed.errors import InputError
from zarrfeed.formats.limits import claimed_bytes, require_bytes

TIFF_SUFFIXES = {".tif", ".tiff"}


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


def read_image(path: str | Path) -> np.ndarray:
    """(H, W) or (H, W, C) array with the file's own dtype (:func:`_shown`: the colours of a
    palette image, not its indices)."""
    path = Path(path)
    try:
        if path.suffix.lower() in TIFF_SUFFIXES:
            return _read_tiff(path)
        # The limit is checked here from the header, not by turning Pillow's warning into an
        # error: warning filters are process-wide, and partitions are read side by side.
        with Image.open(path) as im:
            width, height = im.size
            _require_pixels(path, width * height, (height, width))
            return np.asarray(_shown(im))
    except InputError:
        raise
    except Image.DecompressionBombError as exc:
        raise InputError(path, "at most PIL.Image.MAX_IMAGE_PIXELS pixels", str(exc)) from exc
    except (UnidentifiedImageError, tifffile.TiffFileError, OSError, ValueError) as exc:
        raise InputError(path, "a PNG, JPEG or TIFF image", f"an unreadable file ({exc})") from exc


def write_image(path: str | Path, array: np.ndarray) -> None:
    """Write PNG (uint8/uint16) or TIFF (any dtype) by suffix, deterministically."""
    path = Path(path)
    if path.suffix.lower() in TIFF_SUFFIXES:
        rgb = array.ndim == 3 and array.shape[-1] in (3, 4)
        tifffile.imwrite(path, array, photometric="rgb" if rgb else "minisblack", metadata=None)
    else:
        Image.fromarray(array).save(path, optimize=False)
