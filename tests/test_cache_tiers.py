"""Every cache tier behind one interface: a budget, what it holds, the same statistics by
name, clear() for every process and close() for this one."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from test_training_cache import build_ct, unit_budget_gb
from test_training_feed import BATCH, pool_bytes

from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.store.disktier import DiskTier
from zarrfeed.training.data.arrays import SharedArrayCache
from zarrfeed.training.data.device import DeviceSlots
from zarrfeed.training.data.protocols import TIER_STATS, CacheTier


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_ct(tmp_path_factory.mktemp("tiers") / "store.zarr")  # 16 MB decoded


def arrays_tier(store, tmp_path):
    tier = SharedArrayCache(f"tiers-{uuid.uuid4().hex}", 1 << 20)
    for key in ("a", "b"):
        tier.get(key, lambda: np.ones(1000, np.float32))
    tier.get("a", lambda: np.ones(1000, np.float32))
    return tier


def arena_tier(store, tmp_path):
    ds = CTPatchDataset(store, cache_gb=unit_budget_gb(20))  # 20 of its 64 units
    assert not ds.cache.in_ram
    for index in (0, 0, 1):
        ds[index]
    return ds.cache.arena


def disk_tier(store, tmp_path):
    tier = DiskTier(tmp_path / "tier", 1 << 20)
    tier.put_many([(DiskTier.key("s", f"c/{i}"), bytes(1000)) for i in range(3)])
    tier.flush()
    tier.get(DiskTier.key("s", "c/0"))
    tier.get(DiskTier.key("s", "c/9"))
    return tier


def slots_tier(store, tmp_path):
    ds = CTPatchDataset(store, cache_gb=1)
    tier = DeviceSlots(ds, torch.device("cpu"), pool_bytes(ds, 24), BATCH)
    for start in (0, 0, 2):
        tier.batch(np.arange(start, start + BATCH))
    return tier


@pytest.mark.parametrize("make", [arrays_tier, arena_tier, disk_tier, slots_tier])
def test_every_tier_has_the_one_interface(store, tmp_path, make):
    tier = make(store, tmp_path)
    assert isinstance(tier, CacheTier)
    stats = tier.stats()
    assert set(TIER_STATS) <= set(stats), set(TIER_STATS) - set(stats)
    assert stats["budget_bytes"] == tier.budget_bytes
    assert 0 < tier.capacity_bytes <= tier.budget_bytes
    assert stats["entries"] > 0 and 0 < stats["bytes_held"] <= tier.capacity_bytes
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["bytes_decoded"] > 0
    tier.clear()
    stats = tier.stats()
    assert stats["entries"] == 0 and stats["bytes_held"] == 0
    tier.close()
    tier.close()  # twice is harmless; the tier opens again on its next use
    assert tier.stats()["entries"] == 0
