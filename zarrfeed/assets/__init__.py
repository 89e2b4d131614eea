"""Dagster assets: orchestration only; the work is in transforms, formats and store."""

from zarrfeed.assets.ct import ct_hu, ct_raw_scan, ct_windows

ct_assets = [ct_raw_scan, ct_hu, ct_windows]

__all__ = ["ct_assets"]
