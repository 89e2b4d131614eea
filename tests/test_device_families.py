"""Every family on the device tier (the device set to ``cpu``): image patches with their
defects rendered on the device, spike clips and sparse point sets are cut from the arrays
held on the device, or from a slot pool, as their DataLoader path cuts them, epoch after
epoch and on resume; what the tier cannot serve, the plan refuses with its reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_training_feed import take
from torch.utils.data import Dataset, default_collate

from zarrfeed.families.ct.datasets import CTPatchDataset, SparsePointsDataset
from zarrfeed.families.images.datasets import ImagePatchDataset, render_batch
from zarrfeed.families.spike.datasets import SpikeClipDataset
from zarrfeed.training.data.device import DevicePatches, DeviceSlots, pool_layout
from zarrfeed.training.data.facts import Budgets, World, data_facts, machine_facts
from zarrfeed.training.data.feed import Feed, make_feed
from zarrfeed.training.data.plan import plan_loading
from zarrfeed.training.data.protocols import Boxes, DeviceCuts
from zarrfeed.training.trainer import train
from zarrfeed.transforms.defects import Defects, defect_table, random_defects, render_defects

CPU = torch.device("cpu")
BATCH = 3


def dataset(built, family: str) -> Dataset:
    store = built[0]
    if family == "images":
        return ImagePatchDataset(store, cache_gb=0.1, seed=4)
    if family == "images-plain":
        return ImagePatchDataset(store, defects=False, cache_gb=0.1, seed=4)
    if family == "spike":
        return SpikeClipDataset(store, clip_len=3, crop=(48, 64), cache_gb=0.1, seed=4)
    return SparsePointsDataset(store, window="bone", min_points=4, max_points=50, seed=4)


def collate(ds: Dataset):
    return getattr(ds, "collate", default_collate)


def same(
    a: list[tuple[tuple, dict]],
    b: list[tuple[tuple, dict]],
    atol: float = 1e-6,
    rtol: float = 1e-6,
    equal_nan: bool = False,
) -> None:
    """The same tags and batches: integers exactly, floats within the tolerances (default:
    float32 rounding, as the device may sum overlapping defects in another order)."""
    assert [tag for tag, _ in a] == [tag for tag, _ in b]
    for (tag, x), (_, y) in zip(a, b, strict=True):
        assert sorted(x) == sorted(y), tag
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, (tag, k)
            if x[k].is_floating_point():
                torch.testing.assert_close(x[k], y[k], rtol=rtol, atol=atol, equal_nan=equal_nan)
            else:
                assert torch.equal(x[k], y[k]), (tag, k)


def feed_of(ds: Dataset, on: bool, gb: float = 1.0) -> Feed:
    budgets = Budgets(BATCH, workers=0, order="random", device_cache="on" if on else "off",
                      device_cache_gb=gb)  # fmt: skip
    return make_feed(ds, CPU, budgets, collate_fn=collate(ds), seed=5, log=None)


def device_plan(ds: Dataset, gb: float = 1.0) -> tuple[str, list[str]]:
    plan = plan_loading(
        data_facts(ds, collate(ds), device=True), machine_facts(CPU), World(),
        Budgets(BATCH, workers=0, device_cache="on", device_cache_gb=gb),
    )  # fmt: skip
    return plan.tier, plan.device_reasons


@pytest.mark.parametrize("family", ["images", "images-plain", "spike", "sparse"])
def test_each_family_is_cut_on_the_device_as_its_loader_cuts_it(built, family):
    ds = dataset(built, family)
    assert device_plan(ds)[0] == "volumes"
    per_epoch = len(ds) // BATCH
    n = per_epoch + 3  # into the second epoch: crops, defects and points move on
    loaded, cut = take(feed_of(ds, False), n), take(feed_of(ds, True), n)
    same(loaded, cut)
    if family == "images":  # the defects were drawn, and their masks
        assert any(b["mask"].any() for _, b in cut)
        plain = ImagePatchDataset(built[0], defects=False, cache_gb=0.1, seed=4)
        bare = take(feed_of(plain, True), 2)
        assert any(
            not torch.equal(a["image"], b["image"])
            for (_, a), (_, b) in zip(bare, cut[:2], strict=True)
        )
    # a resumed run reads the same batches from where it stopped
    same(take(feed_of(ds, True), 3, (0, per_epoch - 1)), cut[per_epoch - 1 : per_epoch + 2])


@pytest.mark.parametrize("family", ["images", "spike"])
def test_a_slot_pool_cuts_every_array_of_a_family_under_eviction(built, family):
    ds = dataset(built, family)
    bare = pool_layout(ds, 0, 1)
    budget = bare.tables + bare.staging + bare.gather + bare.need * bare.slot_bytes
    pool = DeviceSlots(ds, CPU, budget, 1)
    assert pool.slots == bare.need and pool.layout.total <= budget
    held = DevicePatches(ds, CPU)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        order = np.random.default_rng(epoch).permutation(len(ds))[:12]
        for index in order:
            want = collate(ds)([ds[int(index)]])
            same([((0,), want)], [((0,), pool.batch(np.array([index])))])
        same([((0,), held.batch(order))], [((0,), collate(ds)([ds[int(i)] for i in order]))])
    assert pool.counts.evictions > 0 and max(pool.counts.history) <= pool.slots


def test_what_the_device_tier_cannot_serve_is_refused_with_its_reason(built):
    store = built[0]
    realtime = SpikeClipDataset(store, clip_len=3, crop=(48, 64), voxels="realtime", cache_gb=0.1)
    tier, reasons = device_plan(realtime)
    assert tier == "loader" and "binned from the raw .dat files on the host" in reasons[0]
    with pytest.raises(ValueError, match=r"raw \.dat files"):
        DevicePatches(realtime, CPU)
    flipped = ImagePatchDataset(store, cache_gb=0.1, transform=lambda s: s)
    assert "transform= runs per sample on the host" in device_plan(flipped)[1][0]
    volumes = CTPatchDataset(store, patch=False, cache_gb=0.1)
    assert "whole volumes" in device_plan(volumes)[1][0]
    # point sets beyond the device budget: their partitions' units differ, no pool
    points = dataset(built, "sparse")
    tier, reasons = device_plan(points, points.nbytes() / 2 / (1 << 30))
    assert tier == "loader" and "scans have different cache units" in reasons[0]

    class Plain(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.zeros(2)}

    assert "Plain names no boxes of cached arrays" in device_plan(Plain())[1][0]


def test_defects_rendered_for_a_batch_equal_the_host_rendering_at_edges_and_overlaps():
    rng = np.random.default_rng(0)
    image = rng.random((3, 3, 16, 20), dtype=np.float32)
    edges = Defects(
        centers=np.array([[0, 0], [15, 19], [0, 19], [7, 9], [7, 10], [8, 9]]),
        sizes=np.array([[3, 5], [3, 3], [3, 5], [3, 5], [3, 3], [3, 5]]),
        sigmas=np.array([[1.0, 1.5], [1.0, 1.0], [1.0, 1.5], [1.0, 1.5], [1.0, 1.0], [1.0, 1.5]]),
        amplitudes=np.array([0.4, -0.3, 0.2, 0.5, -0.45, 0.25]),
        in_mask=np.array([True, False, True, True, False, False]),
    )
    found = [edges, random_defects((16, 20), rng, p_defect=1.0), random_defects((16, 20), rng, 0)]
    want_image, want_mask = image.copy(), np.zeros((3, 1, 16, 20), np.uint8)
    for b, defects in enumerate(found):
        want_image[b, 0], want_mask[b, 0] = render_defects(image[b, 0], defects)
        for c in (1, 2):
            want_image[b, c] = render_defects(image[b, c], defects.select(~defects.in_mask))[0]
    table = {k: torch.from_numpy(v) for k, v in defect_table(found).items()}
    got_image, got_mask = render_batch(torch.from_numpy(image.copy()), table)
    torch.testing.assert_close(got_image, torch.from_numpy(want_image), rtol=1e-6, atol=1e-6)
    assert torch.equal(got_mask, torch.from_numpy(want_mask)) and want_mask[0].any()
    assert not np.array_equal(want_image, image)


def test_a_box_outside_its_array_fails_naming_it(built, monkeypatch):
    ds = dataset(built, "spike")
    held = DevicePatches(ds, CPU)
    good = ds.device_cuts(np.arange(2))
    shift = np.array([0, 0, 1000, 0])  # rows past the recording's height
    moved = Boxes(good.boxes["voxels"].items, good.boxes["voxels"].origins + shift)
    bad = DeviceCuts({**good.boxes, "voxels": moved}, good.extras)
    monkeypatch.setattr(ds, "device_cuts", lambda indices: bad)
    with pytest.raises(ValueError, match=r"'voxels' box .* lies outside voxels of spike/voxels/"):
        held.batch(np.arange(2))


@pytest.mark.parametrize("task", ["defect_segmentation", "spike_deblur", "sparse_autoencoder"])
def test_each_family_trains_alike_on_the_device(built, tmp_path, task):
    from test_training import config

    def run(where: str, device_cache: str) -> tuple[dict, list[str]]:
        lines: list[str] = []
        cfg = config(built, tmp_path / where, task, steps=3, amp="off",
                     log_every=1, batch_size=2)  # fmt: skip
        cfg.dataloader = cfg.dataloader.model_copy(
            update={"device_cache": device_cache, "sampler": "random", "workers": "0"}
        )
        return train(cfg, log=lines.append).history, lines

    cut, lines = run("on", "on")
    assert any("device cache: volumes held on cpu" in s for s in lines), lines
    loaded, _ = run("off", "off")
    np.testing.assert_allclose(cut["loss"], loaded["loss"], rtol=1e-5)
    assert cut["samples"] == loaded["samples"]
