"""Spike-camera ``.dat`` files in either layout, with exact size checks that name the file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np

from zarrfeed.errors import InputError
from zarrfeed.transforms import spike as sp

Layout = Literal["packed", "bytes"]


def read_dat(
    path: str | Path,
    height: int,
    width: int,
    layout: Layout = "packed",
    frames: int | None = None,
) -> np.ndarray:
    """(T, H, W) uint8 spikes from a ``.dat`` file.

    ``packed``: the size must be a whole number of H·W/8-byte frames (and equal ``frames``
    of them when given).  ``bytes``: the size must be exactly ``frames``·H·W, and every
    byte 0 or 1 (a spike or none; 255 for a spike would wrap the uint8 voxel bins).
    """
    path = Path(path)
    size = path.stat().st_size
    if layout == "packed":
        per_frame = sp.packed_frame_bytes(height, width)
        if size == 0 or size % per_frame or (frames is not None and size != frames * per_frame):
            want = f"{frames} × " if frames is not None else "a whole number of "
            raise InputError(
                path,
                f"{want}{per_frame}-byte frames (bit-packed {height}×{width})",
                f"{size} bytes",
            )
        return sp.decode_packed(np.fromfile(path, dtype=np.uint8), height, width)
    if layout == "bytes":
        if frames is None:
            raise ValueError("the 'bytes' layout needs frames=")
        expected = frames * height * width
        if size != expected:
            raise InputError(
                path,
                f"{expected} bytes ({frames}×{height}×{width} uint8); cannot reshape spike data",
                f"{size} bytes",
            )
        spikes = sp.decode_bytes(np.fromfile(path, dtype=np.uint8), frames, height, width)
        top = int(spikes.max(initial=0))
        if top > 1:
            raise InputError(path, "spikes of 0 or 1, one byte per pixel", f"values up to {top}")
        return spikes
    raise ValueError(f"unknown layout {layout!r}: use 'packed' or 'bytes'")


def write_dat(path: str | Path, spikes: np.ndarray, layout: Layout = "packed") -> None:
    """Write (T, H, W) spikes in the given layout (sample data, round-trip tests)."""
    data = (
        sp.encode_packed(spikes) if layout == "packed" else np.ascontiguousarray(spikes, np.uint8)
    )
    Path(path).write_bytes(data.tobytes())
