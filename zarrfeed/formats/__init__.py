"""Readers of raw inputs.  Each error names the file, what was expected and what was found."""

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
