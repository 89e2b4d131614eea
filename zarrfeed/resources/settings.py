"""Build settings: what shapes the stored partitions (their fingerprints declare which).

Each settings resource hands :meth:`values` to the data contract
(``zarrfeed.store.contract``), which hashes the settings an asset declares into its
fingerprint and its code version, so changing one makes exactly the partitions that depend on
it stale.
"""

from __future__ import annotations

from typing import Any

import dagster as dg


class Settings(dg.ConfigurableResource):
    def values(self) -> dict[str, Any]:
        return self.model_dump()


class CTSettings(Settings):
    """How CT volumes are turned into HU, windows, sparse indices and the patch index.

    The CT-CLIP geometry is ``spacing_zyx_mm=[1.5, 0.75, 0.75]``,
    ``crop_pad_zyx=[240, 480, 480]`` and the ``ct-clip`` window ([-1000, 1000] HU).
    """

    # Pydantic copies field defaults per instance, so list defaults are safe here.
    spacing_zyx_mm: list[float] = [1.5, 0.75, 0.75]  # noqa: RUF012
    crop_pad_zyx: list[int] = []  # noqa: RUF012  (empty: keep the resampled extent)
    hu_overrides: dict[str, Any] = {}  # noqa: RUF012  (key: "hu" | {slope, intercept})
    windows: list[str] = ["lung", "mediastinum", "bone"]  # noqa: RUF012
    sparse_threshold: float = 0.5  # a voxel is occupied where its windowed value exceeds this
    sparse_grid: int = 64  # occupancy grid edge (TRELLIS 64³); 0 keeps full resolution
    min_points: int = 16
    patch_zyx: list[int] = [64, 64, 64]  # noqa: RUF012
    patch_stride_zyx: list[int] = [64, 64, 64]  # noqa: RUF012
    body_hu: float = -500.0  # voxels above this count as body for the patch filter
    min_body_fraction: float = 0.25


class SpikeSettings(Settings):
    """Spike voxelisation: camera frames per sample are summed into ``bins`` count images."""

    bins: int = 5  # 10 high-speed frames → 5 bins


class ImageSettings(Settings):
    """The image patch grid and its foreground filter."""

    patch_yx: list[int] = [128, 128]  # noqa: RUF012
    stride_yx: list[int] = [64, 64]  # noqa: RUF012
    foreground: float = 0.02  # grey level (0–1) above which a pixel is foreground
    min_foreground_fraction: float = 0.5


class BuildOptions(dg.ConfigurableResource):
    """``force`` rebuilds partitions whose inputs, code and settings are unchanged.

    Without it a partition already committed with the fingerprint it would get now is reused
    (and re-checked; one whose stored data fails its checks is rebuilt), which makes reruns
    and retried backfills cheap.  Set it per run in the launchpad
    (``resources: build: config: force: true``).
    """

    force: bool = False
