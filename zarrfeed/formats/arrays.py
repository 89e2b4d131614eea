"""``.npy`` and ``.npz`` arrays, never unpickling (``allow_pickle=False``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from zarrfeed.errors import InputError


def read_npy(path: str | Path, mmap: bool = True) -> np.ndarray:
    """A ``.npy`` array, memory-mapped by default so only touched pages are read."""
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except ValueError as exc:
        raise InputError(path, "a .npy array without Python objects", str(exc)) from exc


def read_npz(path: str | Path, key: str | None = None) -> np.ndarray:
    """One array of an ``.npz`` file: ``key``, or the only array it holds."""
    try:
        with np.load(path, allow_pickle=False) as z:
            names = list(z.files)
            if key is None:
                if len(names) != 1:
                    raise InputError(path, "exactly one array (or pass key=)", f"arrays {names}")
                key = names[0]
            if key not in names:
                raise InputError(path, f"an array named {key!r}", f"arrays {names}")
            return z[key]
    except (ValueError, OSError) as exc:
        raise InputError(path, "a readable .npz archive", str(exc)) from exc
