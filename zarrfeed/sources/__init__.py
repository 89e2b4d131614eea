"""Remote sources of raw data (Dagster-free)."""

from zarrfeed.sources.hub import CTRateHub, HubError, HubVolume

__all__ = ["CTRateHub", "HubError", "HubVolume"]
