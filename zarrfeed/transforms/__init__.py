"""Pure array transforms: no file I/O, no Dagster, no Zarr.

Submodules: :mod:`.ct` (HU, windows, resampling, presets), :mod:`.sparse` (occupancy
coordinates), :mod:`.spike` (spike streams), :mod:`.patches` (patch grids and indexes),
:mod:`.defects` (local Gaussian defect synthesis).
"""

from zarrfeed.transforms import ct, defects, patches, sparse, spike

__all__ = ["ct", "defects", "patches", "sparse", "spike"]
