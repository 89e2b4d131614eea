"""Pure array transforms: no file I/O, no Dagster, no Zarr.

Submodules: :mod:`.hu` (the HU rescale decided from evidence, plausibility), :mod:`.ct`
(windows, resampling, crop/pad, presets), :mod:`.sparse` (occupancy
coordinates), :mod:`.spike` (spike streams), :mod:`.patches` (patch grids and indexes),
:mod:`.defects` (local Gaussian defect synthesis).
"""

from zarrfeed.transforms import ct, defects, hu, patches, sparse, spike

__all__ = ["ct", "defects", "hu", "patches", "sparse", "spike"]
