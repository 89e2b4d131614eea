"""``.npy`` and ``.npz`` arrays and CT volumes stored in them, never unpickling.

Every array's header (shape × itemsize) is checked against the bytes its file or zip member
holds before anything is allocated; a compressed member must be able to inflate to it.

A CT volume in an array file is a 3-D (z, y, x) array plus facts a bare array lacks:

* ``<stem>.npy`` and a sidecar ``<stem>.json`` next to it::

      {"spacing_zyx_mm": [z, y, x],       required: voxel size in mm
       "units": "hu" | "raw",             optional: what the values are
       "slope": 1.0, "intercept": -1024}  with "raw": HU = value · slope + intercept

* ``<stem>.npz`` with one array named ``volume`` (or ``image`` or ``data``) and the same
  facts as arrays of the same names (``spacing_zyx_mm`` of 3 floats, 0-d ``units``,
  ``slope``, ``intercept``); a ``<stem>.json`` beside it may give them instead, and where
  both give one they must agree.

Without a spacing the volume is refused, naming the file and how to supply one: a spacing is
never guessed.  ``units``/``slope``/``intercept`` become the ``sidecar`` claim that
:func:`zarrfeed.transforms.hu.decide_hu` tests against the data; without them the data alone
decides.  Windowed volumes (values in [0, 1]) cannot be turned back into HU and fail there.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from zarrfeed.errors import InputError
from zarrfeed.formats.limits import (
    claimed_bytes,
    fill,
    require_allocatable,
    require_bytes,
    require_inflatable,
)
from zarrfeed.formats.volume import Volume
from zarrfeed.transforms.hu import IDENTITY, Rescale

VOLUME_ARRAYS = ("volume", "image", "data")
FACTS = ("spacing_zyx_mm", "units", "slope", "intercept")
_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _array_header(f: BinaryIO, path: Path | str, what: str) -> tuple[tuple, bool, np.dtype]:
    """(shape, fortran order, dtype) of the ``.npy`` stream ``f``, left at the data."""
    try:
        version = np.lib.format.read_magic(f)
        shape, fortran, dtype = _HEADER_READERS[version](f)
    except (ValueError, KeyError, EOFError, OSError) as exc:
        raise InputError(path, f"{what}: a .npy header (format 1.0 or 2.0)", str(exc)) from exc
    if dtype.hasobject:
        raise InputError(path, f"{what}: an array without Python objects", f"dtype {dtype}")
    return shape, fortran, dtype


def read_npy(path: str | Path, mmap: bool = True) -> np.ndarray:
    """A ``.npy`` array, memory-mapped by default so only touched pages are read."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            shape, _, dtype = _array_header(f, path, "an array")
            start = f.tell()
    except OSError as exc:
        raise InputError(path, "a readable .npy file", str(exc)) from exc
    what = f"a {shape} {dtype} array"
    require_bytes(path, start + claimed_bytes(shape, dtype.itemsize), path.stat().st_size, what)
    return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)


def npz_names(path: str | Path) -> list[str]:
    """Names of the arrays in an ``.npz`` archive, in archive order."""
    try:
        with zipfile.ZipFile(path) as z:
            return [n.removesuffix(".npy") for n in z.namelist()]
    except (zipfile.BadZipFile, OSError) as exc:
        raise InputError(path, "a readable .npz archive", str(exc)) from exc


def read_npz(path: str | Path, key: str | None = None) -> np.ndarray:
    """One array of an ``.npz`` file: ``key``, or the only array it holds.

    The member is inflated into a buffer of exactly the size its header claims, once that
    size has been checked against the member's (compressed) size.
    """
    names = npz_names(path)
    if key is None:
        if len(names) != 1:
            raise InputError(path, "exactly one array (or pass key=)", f"arrays {names}")
        key = names[0]
    if key not in names:
        raise InputError(path, f"an array named {key!r}", f"arrays {names}")
    with zipfile.ZipFile(path) as z:
        members = z.namelist()  # np.savez adds ".npy"; other writers may not
        info = z.getinfo(f"{key}.npy" if f"{key}.npy" in members else key)
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            # bzip2 and LZMA have no bound on what a member inflates to, unlike deflate
            what = f"array {key!r} stored or deflated (np.savez, np.savez_compressed)"
            raise InputError(path, what, f"zip compression method {info.compress_type}")
        try:
            with z.open(info) as f:
                shape, fortran, dtype = _array_header(f, path, f"array {key!r}")
                needed = claimed_bytes(shape, dtype.itemsize)
                what = f"array {key!r}: {shape} {dtype}"
                require_bytes(path, f.tell() + needed, info.file_size, what)
                if info.compress_type == zipfile.ZIP_DEFLATED:
                    require_inflatable(path, needed, info.compress_size, what)
                require_allocatable(path, needed, what)
                buf = np.empty(needed, dtype=np.uint8)
                got = fill(f, buf)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise InputError(path, f"a readable array {key!r}", str(exc)) from exc
    if got < needed:
        raise InputError(path, f"{needed} bytes of array {key!r}", f"{got} bytes")
    return buf.view(dtype).reshape(shape, order="F" if fortran else "C")


def _stem(path: Path) -> str:
    return path.name.removesuffix(path.suffix)


def _facts_from_npz(path: Path, names: list[str]) -> dict:
    return {n: read_npz(path, n).tolist() for n in FACTS if n in names}


def _facts_from_sidecar(sidecar: Path) -> dict:
    expected = f"a JSON object with fields among {list(FACTS)}"
    try:
        facts = json.loads(sidecar.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(sidecar, expected, str(exc)) from exc
    if not isinstance(facts, dict) or set(facts) - set(FACTS):
        found = sorted(set(facts) - set(FACTS)) if isinstance(facts, dict) else facts
        raise InputError(sidecar, expected, f"{found!r}")
    return facts


def _merge(path: Path, own: dict, sidecar: Path) -> dict:
    if not sidecar.exists():
        return own
    merged = dict(own)
    for name, value in _facts_from_sidecar(sidecar).items():
        if name in own and not _same(own[name], value):
            raise InputError(sidecar, f"{name} = {own[name]!r} as in {path.name}", repr(value))
        merged[name] = value
    return merged


def _same(a: object, b: object) -> bool:
    """Equal facts; numbers up to float32 rounding (an archive's float32 spacing and its
    sidecar's decimal one are the same claim)."""
    try:
        x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    except (TypeError, ValueError):
        return a == b
    return x.shape == y.shape and bool(np.allclose(x, y, rtol=1e-6, atol=0))


def _spacing(path: Path, sidecar: Path, value) -> tuple[float, float, float]:
    if value is None:
        raise InputError(
            path,
            f'a spacing: {sidecar.name} with {{"spacing_zyx_mm": [z, y, x]}} in mm'
            + (
                " or an array spacing_zyx_mm in the archive"
                if path.suffix.lower() == ".npz"
                else ""
            ),
            "none (a spacing is never guessed)",
        )
    try:
        spacing = () if isinstance(value, str | bytes) else tuple(float(v) for v in value)
    except (TypeError, ValueError):
        spacing = ()
    if len(spacing) != 3 or not all(np.isfinite(s) and s > 0 for s in spacing):
        raise InputError(path, "spacing_zyx_mm: three positive numbers (mm)", repr(value))
    return spacing


def _claims(path: Path, facts: dict) -> dict[str, Rescale]:
    units = facts.get("units")
    given = [n for n in ("slope", "intercept") if n in facts]
    if units == "hu" and not given:
        return {"sidecar": IDENTITY}
    if units in ("raw", None) and len(given) == 2:
        try:
            return {"sidecar": Rescale(float(facts["slope"]), float(facts["intercept"]))}
        except (TypeError, ValueError) as exc:
            raise InputError(path, "a numeric slope and intercept", str(exc)) from exc
    if units is None and not given:
        return {}
    raise InputError(
        path,
        'units "hu" alone, or "raw" with a slope and an intercept',
        f"units {units!r} with {given or 'no'} slope/intercept",
    )


def read_array_volume(path: str | Path) -> Volume:
    """A CT volume from a ``.npy`` or ``.npz`` file and its spacing (module docstring)."""
    path = Path(path)
    if path.suffix.lower() == ".npz":
        names = npz_names(path)
        found = [n for n in VOLUME_ARRAYS if n in names]
        if len(found) != 1:
            raise InputError(path, f"one array named {' or '.join(VOLUME_ARRAYS)}", str(names))
        data, own = read_npz(path, found[0]), _facts_from_npz(path, names)
    else:
        data, own = read_npy(path), {}
    if data.ndim != 3 or data.dtype.kind not in "iuf":
        raise InputError(path, "a 3-D (z, y, x) numeric array", f"{data.shape} {data.dtype}")
    # A .npy is memory-mapped, but the build makes a float32 HU copy of it: bound that.
    what = f"the float32 HU copy of a {data.shape} {data.dtype} volume"
    require_allocatable(path, claimed_bytes(data.shape, 4), what)
    sidecar = path.with_name(_stem(path) + ".json")
    facts = _merge(path, own, sidecar)
    return Volume(
        data=data,
        spacing=_spacing(path, sidecar, facts.get("spacing_zyx_mm")),
        source=str(path),
        claims=_claims(path, facts),
        meta={"facts": facts},
    )
