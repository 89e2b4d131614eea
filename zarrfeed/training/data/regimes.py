"""Which cache a dataset's arrays get: whole arrays in RAM when every one of them fits the
budget together, else units out of core."""

from __future__ import annotations

from typing import Any

from zarrfeed.store import ZarrStore
from zarrfeed.training.data.inram import InRamArrays
from zarrfeed.training.data.outofcore import OutOfCoreArrays
from zarrfeed.training.data.reader import CachedArrays
from zarrfeed.training.data.units import UnitIndex


def cached_arrays(
    store: ZarrStore,
    sources: dict[str, tuple[list[dict[str, Any]], list[str]]],
    budget_bytes: int,
) -> CachedArrays:
    """The arrays of ``sources`` through the regime their decoded size and the budget pick."""
    units = UnitIndex(sources)
    regime = InRamArrays if units.nbytes <= int(budget_bytes) else OutOfCoreArrays
    return regime(store, units, budget_bytes)
