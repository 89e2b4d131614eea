"""Dagster resources: configuration plus the Dagster-free objects they hand out."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from zarrfeed.formats.discover import find_ct_scans, read_ct_rate_metadata
from zarrfeed.store import ZarrStore

DEFAULT_STORE = os.environ.get("ZARRFEED_STORE", "data/zarrfeed.zarr")
DEFAULT_RAW = os.environ.get("ZARRFEED_RAW", "data/raw")


class ZarrStoreResource(dg.ConfigurableResource):
    """The Zarr store every asset writes to: a folder or an fsspec URL (``ZARRFEED_STORE``)."""

    url: str = DEFAULT_STORE

    def store(self) -> ZarrStore:
        return ZarrStore(self.url)


class RawFolderResource(dg.ConfigurableResource):
    """The raw-data folder (``ZARRFEED_RAW``): CT volumes, spike sequences, image sets."""

    root: str = DEFAULT_RAW

    def ct_scans(self) -> dict[str, Path]:
        return find_ct_scans(self.root)

    def ct_metadata(self) -> dict[str, dict[str, str]]:
        return read_ct_rate_metadata(self.root)


class CTSettings(dg.ConfigurableResource):
    """How CT volumes are preprocessed; recorded in every partition's provenance."""

    # Pydantic copies field defaults per instance, so list defaults are safe here.
    spacing_zyx_mm: list[float] = [1.5, 0.75, 0.75]  # noqa: RUF012  (CT-CLIP geometry)
    windows: list[str] = ["lung", "mediastinum", "bone"]  # noqa: RUF012
