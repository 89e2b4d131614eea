"""Readers of raw inputs.  Each error names the file, what was expected and what was found."""

from zarrfeed.formats.arrays import read_array_volume, read_npy, read_npz
from zarrfeed.formats.ct import CTItem, ct_clip_input, read_ct
from zarrfeed.formats.dicom import read_dicom_series, write_dicom_series
from zarrfeed.formats.discover import (
    Found,
    discover_ct,
    discover_image_sets,
    discover_spike_sequences,
)
from zarrfeed.formats.images import read_image, write_image
from zarrfeed.formats.nifti import read_nifti, read_nifti_header, write_nifti
from zarrfeed.formats.spike import read_dat, write_dat
from zarrfeed.formats.volume import Volume

__all__ = [
    "CTItem",
    "Found",
    "Volume",
    "ct_clip_input",
    "discover_ct",
    "discover_image_sets",
    "discover_spike_sequences",
    "read_array_volume",
    "read_ct",
    "read_dat",
    "read_dicom_series",
    "read_image",
    "read_nifti",
    "read_nifti_header",
    "read_npy",
    "read_npz",
    "write_dat",
    "write_dicom_series",
    "write_image",
    "write_nifti",
]
