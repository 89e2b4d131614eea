"""Readers of raw inputs.  Each error names the file, what was expected and what was found.

The public names load their module on first use, and the readers import nibabel and pydicom
when they read: a code location that only declares the families (every Dagster run worker
loads one) then skips ~0.6 s of their imports."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zarrfeed.formats.arrays import read_array_volume, read_npy, read_npz
    from zarrfeed.formats.ct import CTItem, ct_clip_input, read_ct
    from zarrfeed.formats.dicom import read_dicom_series, write_dicom_series
    from zarrfeed.formats.images import read_image, write_image
    from zarrfeed.formats.nifti import read_nifti, read_nifti_header, write_nifti
    from zarrfeed.formats.spike import read_dat, write_dat
    from zarrfeed.formats.volume import Volume
    from zarrfeed.formats.walk import Found, Tree, TreeCache, walk_tree

__all__ = [
    "CTItem",
    "Found",
    "Tree",
    "TreeCache",
    "Volume",
    "ct_clip_input",
    "read_array_volume",
    "read_ct",
    "read_dat",
    "read_dicom_series",
    "read_image",
    "read_nifti",
    "read_nifti_header",
    "read_npy",
    "read_npz",
    "walk_tree",
    "write_dat",
    "write_dicom_series",
    "write_image",
    "write_nifti",
]
_HOMES = {  # each public name's module
    "CTItem": "ct",
    "Found": "walk",
    "Tree": "walk",
    "TreeCache": "walk",
    "Volume": "volume",
    "ct_clip_input": "ct",
    "read_array_volume": "arrays",
    "read_ct": "ct",
    "read_dat": "spike",
    "read_dicom_series": "dicom",
    "read_image": "images",
    "read_nifti": "nifti",
    "read_nifti_header": "nifti",
    "read_npy": "arrays",
    "read_npz": "arrays",
    "walk_tree": "walk",
    "write_dat": "spike",
    "write_dicom_series": "dicom",
    "write_image": "images",
    "write_nifti": "nifti",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'zarrfeed.formats' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zarrfeed.formats.{_HOMES[name]}"), name)
