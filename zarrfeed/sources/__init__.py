"""Remote sources of raw data (Dagster-free).

The public names load :mod:`zarrfeed.sources.hub` on first use: its client (huggingface_hub,
httpx) is not imported by the catalog and raw-folder modules every family declaration uses."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zarrfeed.sources.hub import CTRateHub, HubError, HubVolume

__all__ = ["CTRateHub", "HubError", "HubVolume"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'zarrfeed.sources' has no attribute {name!r}")
    return getattr(importlib.import_module("zarrfeed.sources.hub"), name)
