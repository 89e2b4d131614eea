"""The in-memory result of reading a CT volume, whatever its file format."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Volume:
    """Voxels in (z, y, x) order with their spacing in mm and the facts read from the header.

    ``data`` holds stored values; ``slope``/``intercept`` turn them into HU
    (``zarrfeed.transforms.ct.to_hu``).  DICOM readers apply the rescale themselves and set
    slope 1, intercept 0.
    """

    data: np.ndarray
    spacing: tuple[float, float, float]
    source: str
    slope: float = 1.0
    intercept: float = 0.0
    affine: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)
