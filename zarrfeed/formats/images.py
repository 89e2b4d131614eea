"""2-D images: PNG/JPEG through Pillow, TIFF (any dtype, any channels) through tifffile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tifffile
from PIL import Image, UnidentifiedImageError

from zarrfeed.errors import InputError

TIFF_SUFFIXES = {".tif", ".tiff"}


def read_image(path: str | Path) -> np.ndarray:
    """(H, W) or (H, W, C) array with the file's own dtype."""
    path = Path(path)
    try:
        if path.suffix.lower() in TIFF_SUFFIXES:
            return tifffile.imread(path)
        with Image.open(path) as im:
            return np.asarray(im)
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
