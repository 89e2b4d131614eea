"""The in-memory result of reading a CT volume, whatever its file format."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from zarrfeed.errors import InputError
from zarrfeed.transforms import hu


@dataclass
class Volume:
    """Stored values in (z, y, x) order, spacing in mm, and the evidence for HU.

    ``claims`` holds what the file itself says about its rescale, keyed by source
    (``dicom``, ``nifti_header``, ``sidecar``; see :mod:`zarrfeed.transforms.hu`);
    ``padding`` marks voxels the file declares outside the field of view.  Non-finite
    voxels are refused here, so no reader can hand NaN or Inf on.
    """

    data: np.ndarray
    spacing: tuple[float, float, float]
    source: str
    claims: dict[str, hu.Rescale] = field(default_factory=dict)
    padding: np.ndarray | None = None
    affine: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.data.dtype.kind == "f":
            bad = self.data.size - int(np.count_nonzero(np.isfinite(self.data)))
            if bad:
                raise InputError(
                    self.source, "finite voxel values", f"{bad} NaN/Inf of {self.data.size}"
                )
        if not all(np.isfinite(s) and s > 0 for s in self.spacing):
            raise InputError(self.source, "a positive spacing in mm", str(self.spacing))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def to_hu(
        self, csv: hu.Rescale | None = None, override: hu.Rescale | hu.Override | None = None
    ) -> tuple[np.ndarray, hu.HuDecision]:
        """float32 HU with padding turned to air, and the decision (for provenance).

        ``csv`` is the CT-RATE metadata claim (:func:`zarrfeed.transforms.hu.csv_rescale`),
        ``override`` the user's per-scan entry; :class:`InputError` when evidence conflicts.
        """
        claims = dict(self.claims) if csv is None else {**self.claims, "csv": csv}
        decision = hu.decide_hu(
            self.data, self.source, claims, padding=self.padding, override=override
        )
        return hu.to_hu(self.data, decision, self.padding), decision


# Where the (z, y, x) indices of every volume the readers return grow: superior, anterior,
# the patient's right (RAS+ voxel axes, transposed by to_ras).
ZYX_AXES = "SAR"


def to_ras(
    data: np.ndarray, affine: np.ndarray, zooms: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    """Voxel axes (i, j, k) with their RAS+ ``affine`` and ``zooms`` brought to RAS+ and
    transposed to (z, y, x) = (S, A, R): every scan in one orientation, whatever its format.
    Returns the (view of the) data, the affine of the result and its (z, y, x) spacing."""
    import nibabel as nib  # here, not at the top: ~0.6 s that declaring CT items never needs

    ornt = nib.orientations.io_orientation(affine)
    out = nib.orientations.apply_orientation(data, ornt)
    affine = affine @ nib.orientations.inv_ornt_aff(ornt, data.shape)
    zooms = tuple(zooms[int(axis)] for axis in ornt[:, 0].argsort())
    return out.transpose(2, 1, 0), affine, (zooms[2], zooms[1], zooms[0])


# Rotations of the voxel axes up to this far (radians) off the nearest world axes are
# rounding in the header (float32 quaternions), not an oblique acquisition.
OBLIQUE_TOLERANCE_RAD = 1e-3


def off_axis_angle(affine: np.ndarray) -> float:
    """The largest angle (radians) between a voxel axis of ``affine`` and the world axis
    nearest it: 0 for an axis-aligned scan, 30° for one rotated 30° about z.  A shear counts
    too (its columns lean off their axes)."""
    columns = np.asarray(affine, dtype=float)[:3, :3]
    columns = columns / np.linalg.norm(columns, axis=0)
    return float(np.arccos(np.clip(np.abs(columns).max(axis=0).min(), -1.0, 1.0)))
