"""Dagster resources: configuration plus the Dagster-free objects they hand out."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from zarrfeed.formats.discover import (
    SpikeSequence,
    find_ct_scans,
    find_image_sets,
    find_spike_sequences,
    read_ct_rate_labels,
    read_ct_rate_metadata,
)
from zarrfeed.sources import CTRateHub
from zarrfeed.store import ZarrStore

DEFAULT_STORE = os.environ.get("ZARRFEED_STORE", "data/zarrfeed.zarr")
DEFAULT_RAW = os.environ.get("ZARRFEED_RAW", "data/raw")
DEFAULT_MODELS = os.environ.get("ZARRFEED_MODELS", "data/models")


class ZarrStoreResource(dg.ConfigurableResource):
    """The Zarr store every asset writes to: a folder or an fsspec URL (``ZARRFEED_STORE``)."""

    url: str = DEFAULT_STORE

    def store(self) -> ZarrStore:
        return ZarrStore(self.url)


class ModelsResource(dg.ConfigurableResource):
    """Where training runs keep checkpoints, metrics and loss curves (``ZARRFEED_MODELS``):
    ``<root>/<task>/<run>/``."""

    root: str = DEFAULT_MODELS


class RawFolderResource(dg.ConfigurableResource):
    """The raw-data folder (``ZARRFEED_RAW``): CT volumes, spike sequences, image sets."""

    root: str = DEFAULT_RAW

    def ct_scans(self) -> dict[str, Path]:
        return find_ct_scans(self.root)

    def ct_metadata(self) -> dict[str, dict[str, str]]:
        return read_ct_rate_metadata(self.root)

    def ct_labels(self) -> tuple[list[str], dict[str, list[int]]]:
        return read_ct_rate_labels(self.root)

    def spike_sequences(self) -> dict[str, SpikeSequence]:
        return find_spike_sequences(self.root)

    def image_sets(self) -> dict[str, Path]:
        return find_image_sets(self.root)


class HuggingFaceResource(dg.ConfigurableResource):
    """The CT-RATE repository on the Hugging Face hub.

    The token is read from ``HF_TOKEN`` when a request is made; it is not a field, so it
    never shows in the launchpad, run config or metadata.  ``HF_ENDPOINT`` (read by
    huggingface_hub) or ``endpoint`` points at another hub.
    """

    repo_id: str = "ibrahimhamamci/CT-RATE"
    revision: str = "main"
    split: str = "valid"  # the *_fixed folder of this split
    cache_dir: str | None = None  # default: the huggingface_hub cache (HF_HUB_CACHE)
    endpoint: str | None = None
    max_scans: int | None = None  # a cap for trial runs
    download_retries: int = 4
    delete_after_commit: bool = False  # remove each download once its partition is committed

    def hub(self) -> CTRateHub:
        return CTRateHub(
            self.repo_id,
            self.revision,
            self.split,
            cache_dir=self.cache_dir,
            endpoint=self.endpoint,
            max_scans=self.max_scans,
            retries=self.download_retries,
        )


class BuildOptions(dg.ConfigurableResource):
    """``force`` rebuilds partitions whose inputs, code and parameters are unchanged.

    Without it a partition already committed from the same inputs is reused (and re-checked),
    which makes reruns and retried backfills cheap.  Set per run in the launchpad
    (``resources: build: config: force: true``) or with ``ZARRFEED_FORCE=1``.
    """

    force: bool = os.environ.get("ZARRFEED_FORCE", "") in ("1", "true", "yes")


class CTSettings(dg.ConfigurableResource):
    """How CT volumes are preprocessed and indexed; recorded in every partition's provenance."""

    # Pydantic copies field defaults per instance, so list defaults are safe here.
    spacing_zyx_mm: list[float] = [1.5, 0.75, 0.75]  # noqa: RUF012  (CT-CLIP geometry)
    windows: list[str] = ["lung", "mediastinum", "bone"]  # noqa: RUF012
    sparse_threshold: float = 0.5  # a voxel is occupied where its windowed value exceeds this
    sparse_grid: int = 64  # occupancy grid edge (TRELLIS 64³); 0 keeps full resolution
    min_points: int = 16
    patch_zyx: list[int] = [64, 64, 64]  # noqa: RUF012
    patch_stride_zyx: list[int] = [64, 64, 64]  # noqa: RUF012
    body_hu: float = -500.0  # voxels above this count as body for the patch filter
    min_body_fraction: float = 0.25


class SpikeSettings(dg.ConfigurableResource):
    """Spike voxelisation: camera frames per sample are summed into ``bins`` count images."""

    bins: int = 5  # seed 001: 10 high-speed frames → 5 bins


class ImageSettings(dg.ConfigurableResource):
    """The image patch grid and its foreground filter."""

    patch_yx: list[int] = [128, 128]  # noqa: RUF012
    stride_yx: list[int] = [64, 64]  # noqa: RUF012
    foreground: float = 0.02  # grey level (0–1) above which a pixel is foreground
    min_foreground_fraction: float = 0.5
