"""The pipelined feed and the device cache tier, on the CPU (the device set to ``cpu``): the
same batches in every mode, exact resume, the slot pool within its budget, and no stall at an
epoch boundary."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from test_training_cache import PATCH, build_ct, expected
from torch.utils.data import Dataset

from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.training.data import ring as ring_module
from zarrfeed.training.data.device import GATHER_BYTES_PER_VOXEL, DeviceSlots, pool_layout
from zarrfeed.training.data.epochs import EpochChain, EpochIndexed, LoaderKeys
from zarrfeed.training.data.facts import Budgets, World, data_facts, machine_facts
from zarrfeed.training.data.feed import Feed, make_feed
from zarrfeed.training.data.loader import make_loader
from zarrfeed.training.data.plan import plan_loading
from zarrfeed.training.data.ring import RELEASE, BatchRing, settle
from zarrfeed.training.data.sampler import BlockSampler, ResumableSampler
from zarrfeed.training.trainer import train

CPU = torch.device("cpu")
UNIT = 64**3 * 2  # the store's cache unit: one 64³ float16 chunk
BATCH = 2  # a batch of 32³ patches overlaps at most 2 x 8 units


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # 8 scans of 2 x 2 x 3 units (the last ones partial): 96 units
    return build_ct(tmp_path_factory.mktemp("feed") / "store.zarr", shape=(96, 128, 160))


def pool_bytes(ds: CTPatchDataset, slots: int) -> int:
    """A device budget that holds ``slots`` units besides the pool's tables, staging and
    gather scratch."""
    bare = pool_layout(ds, 0, BATCH)
    return bare.tables + bare.staging + bare.gather + slots * UNIT


def device_tier(ds: CTPatchDataset, mode: str, gb: float | None = None) -> tuple[str, list[str]]:
    """(tier, device reasons) the loading plan picks for ``ds`` on the CPU."""
    plan = plan_loading(
        data_facts(ds, ds.collate, device=True, batch_size=BATCH), machine_facts(CPU), World(),
        Budgets(BATCH, workers=0, device_cache=mode, device_cache_gb=gb),
    )  # fmt: skip
    return plan.tier, plan.device_reasons


def feed_of(ds: CTPatchDataset, mode: str, order: str, workers: int = 0) -> Feed:
    """``mode``: "loader" (the DataLoader path), "volumes" or "slots" (a pool of a sixth of
    the dataset's units)."""
    gb = {"loader": None, "volumes": 1.0, "slots": pool_bytes(ds, 16) / (1 << 30)}[mode]
    budgets = Budgets(
        BATCH, workers=workers, order=order, device_cache="off" if gb is None else "on",
        device_cache_gb=gb, context="forkserver",
    )  # fmt: skip
    return make_feed(ds, CPU, budgets, seed=5, log=None)


def take(feed: Feed, n: int, start: tuple[int, int] = (0, 0)) -> list[tuple[tuple, dict]]:
    feed.begin(*start)
    try:
        return [feed.next() for _ in range(n)]
    finally:
        feed.close()


def same(a: list[tuple[tuple, dict]], b: list[tuple[tuple, dict]]) -> None:
    assert [tag for tag, _ in a] == [tag for tag, _ in b]
    for (tag, x), (_, y) in zip(a, b, strict=True):
        assert sorted(x) == sorted(y), tag
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (tag, k)


@pytest.mark.parametrize("order", ["random", "block"])
def test_every_mode_gives_the_same_batches_in_the_same_order(store, order):
    ds = CTPatchDataset(store, cache_gb=1)
    per_epoch = len(ds) // BATCH
    n = per_epoch + 6  # across an epoch boundary
    runs = {mode: take(feed_of(ds, mode, order), n) for mode in ("loader", "volumes", "slots")}
    assert runs["loader"][per_epoch][0] == (1, 0)
    for mode in ("volumes", "slots"):
        same(runs["loader"], runs[mode])
    for _, batch in runs["slots"]:
        image = batch["image"]
        assert image.shape == (BATCH, 1, PATCH, PATCH, PATCH) and image.dtype == torch.float16
    if order == "random":  # and they are the right patches: each voxel says where it is from
        for row, index in enumerate(list(ResumableSampler(len(ds), seed=5))[: 3 * BATCH]):
            image = runs["slots"][row // BATCH][1]["image"][row % BATCH, 0]
            np.testing.assert_array_equal(image.numpy(), expected(ds, index))
    # an epoch is every sample once (the first epoch's batches)
    epoch0 = np.concatenate([b["item"].numpy() for _, b in runs["loader"][:per_epoch]])
    assert np.array_equal(np.sort(epoch0), np.sort(ds.items.astype(np.int64)))


def test_placed_patches_are_cut_alike_on_the_device_and_a_transform_keeps_the_loader(store):
    """Uniform placement changes every epoch: the device tiers cut the patches the DataLoader
    path cuts, epoch by epoch; a per-sample transform keeps batches on the DataLoader path."""
    ds = CTPatchDataset(store, cache_gb=1, patch_sampler="uniform", seed=3)
    per_epoch = len(ds) // BATCH
    runs = {mode: take(feed_of(ds, mode, "random"), per_epoch + 3)
            for mode in ("loader", "volumes", "slots")}  # fmt: skip
    for mode in ("volumes", "slots"):
        same(runs["loader"], runs[mode])
    stored = take(feed_of(CTPatchDataset(store, cache_gb=1, seed=3), "volumes", "random"), 3)
    assert any(
        not torch.equal(a["image"], b["image"])
        for (_, a), (_, b) in zip(stored, runs["volumes"], strict=False)
    )  # the placement did move the patches
    flipped = CTPatchDataset(store, cache_gb=1, transform=lambda s: s)
    tier, reasons = device_tier(flipped, "on", 1.0)
    assert tier == "loader" and "transform" in reasons[0]


@pytest.mark.parametrize("mode", ["loader", "slots"])
def test_resume_mid_epoch_and_at_its_end_is_exact(store, mode):
    ds = CTPatchDataset(store, cache_gb=1)
    per_epoch = len(ds) // BATCH
    workers = 1 if mode == "loader" else 0  # one persistent worker process across epochs
    whole = take(feed_of(ds, mode, "auto", workers), per_epoch + 4)
    same(take(feed_of(ds, mode, "auto", workers), 10, (0, 30)), whole[30:40])
    # a checkpoint taken after an epoch's last batch records (epoch, per_epoch)
    same(take(feed_of(ds, mode, "auto"), 4, (0, per_epoch)), whole[per_epoch:])


def test_the_slot_pool_stays_within_its_budget_under_eviction(store):
    ds = CTPatchDataset(store, cache_gb=1)
    budget = pool_bytes(ds, 16) + UNIT // 2  # a sixth of the dataset's 96 units (not a slot more)
    pool = DeviceSlots(ds, CPU, budget, BATCH)
    layout = pool.layout
    assert pool.slots == 16 and pool.nbytes() == 16 * UNIT and layout.total <= budget
    # what it holds besides its slots is inside the budget too, as the plan says
    tables = pool._slot_of_dev.nbytes + sum(t.nbytes for t in pool._tables.values())
    staging = sum(stage.nbytes for stage in pool._stages)
    assert tables <= layout.tables and staging <= layout.staging
    assert layout.gather == GATHER_BYTES_PER_VOXEL * BATCH * PATCH**3
    assert "16 slots of 0.52 MB units" in layout.describe()
    storage = pool.pool.untyped_storage().nbytes()
    order = np.random.default_rng(0).permutation(len(ds))
    for start in range(0, len(order) - BATCH + 1, BATCH):
        indices = order[start : start + BATCH]
        got = pool.batch(indices)
        for row, index in enumerate(indices):
            np.testing.assert_array_equal(got["image"][row, 0].numpy(), expected(ds, int(index)))
    stats = pool.counts
    assert stats.evictions > 0 and stats.uploads > pool.slots  # the pool did cycle
    assert max(stats.history) <= pool.slots and pool.resident() <= pool.slots
    assert pool.pool.untyped_storage().nbytes() == storage  # nothing grew
    assert stats.hits > 0  # units shared by consecutive batches were not uploaded twice
    with pytest.raises(ValueError, match="a batch may need 16"):
        DeviceSlots(ds, CPU, pool_bytes(ds, 15), BATCH)
    tier, reasons = device_tier(ds, "on", pool_bytes(ds, 15) / (1 << 30))
    assert tier == "loader" and "a batch may need 16 units" in reasons[0]
    tier, reasons = device_tier(ds, "on", budget / (1 << 30))
    assert tier == "slots" and layout.describe() in reasons[0]
    assert device_tier(ds, "auto")[0] == "loader"  # auto: CUDA only


def test_a_unit_the_device_table_lost_is_refused_not_cut_from_other_bytes(store):
    ds = CTPatchDataset(store, cache_gb=1)
    pool = DeviceSlots(ds, CPU, pool_bytes(ds, 16), BATCH)
    indices = np.arange(BATCH)
    pool.batch(indices)
    pool._slot_of_dev[:] = -1  # the host mirror still has them resident: none goes up again
    with pytest.raises(IndexError):
        pool.batch(indices)


def test_the_pool_uploads_the_next_block_while_this_one_trains(store):
    """With the block sampler, each block's units are on the device before its first batch
    (only the first block waits for uploads), within the budget, under eviction, and the
    batches are the DataLoader path's."""
    ds = CTPatchDataset(store, cache_gb=1)
    budget = pool_bytes(ds, 24)  # a quarter of the units; a block (one scan, 12 units): half
    per_epoch = len(ds) // BATCH
    lines: list[str] = []
    budgets = Budgets(BATCH, workers=0, order="auto", device_cache="on",
                      device_cache_gb=budget / (1 << 30))  # fmt: skip
    feed = make_feed(ds, CPU, budgets, seed=5, log=lines.append)
    pool = feed.source
    got = take(feed, 2 * per_epoch + 3)
    # the DataLoader path over the same block order
    chain = EpochChain(BlockSampler(ds, seed=5, block_bytes=pool.nbytes() // 2), BATCH)
    keys = LoaderKeys(chain)
    loader = torch.utils.data.DataLoader(EpochIndexed(ds), batch_sampler=keys,
                                         collate_fn=ds.collate)  # fmt: skip

    def produce(start):
        keys.start_with(start)
        for batch in loader:
            yield keys.tags.popleft(), batch

    same(take(Feed(produce, CPU, chain.per_epoch), 2 * per_epoch + 3), got)
    stats = pool.counts
    assert stats.evictions > 0 and max(stats.history) <= pool.slots == 24
    assert pool.layout.total <= budget
    # every unit came up ahead of its block but the first block's (blocks are whole batches)
    blocks = [np.split(order, starts[1:]) for order, starts in map(chain.sampler.plan, range(3))]
    first = np.unique(ds.sample_units(blocks[0][0]))
    assert stats.on_demand == len(first) and stats.uploads == stats.on_demand + stats.ahead
    assert stats.ahead > 2 * len(blocks[0])  # (at least one unit per later block)
    assert any("next block's, uploaded a few per batch" in line for line in lines), lines


@pytest.mark.parametrize("mode", ["loader", "volumes"])
def test_the_next_epoch_is_ready_before_a_slow_step_ends(store, mode):
    ds = CTPatchDataset(store, cache_gb=1)
    budgets = Budgets(
        32, workers=1 if mode == "loader" else 0, order="random",
        device_cache="off" if mode == "loader" else "on", device_cache_gb=1.0,
        context="forkserver",
    )  # fmt: skip
    feed = make_feed(ds, CPU, budgets, log=None)
    assert feed.per_epoch == 4
    feed.begin(0, 0)
    try:
        tags = [feed.next()[0] for _ in range(4)]
        assert tags == [(0, p) for p in range(4)]
        # a slow step on epoch 0's last batch: the feed crosses the boundary meanwhile
        deadline = time.monotonic() + 10
        while (1, 0) not in feed.ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert feed.ready()[:1] == [(1, 0)], feed.ready()
        t0 = time.perf_counter()
        assert feed.next()[0] == (1, 0)
        assert time.perf_counter() - t0 < 0.05  # taken, not waited for
    finally:
        feed.close()


class EpochProbe(Dataset):
    """Reports the epoch it saw for each sample (slowly, so workers overlap epochs)."""

    def __init__(self) -> None:
        self.epoch = 0

    def __len__(self) -> int:
        return 8

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> dict:
        time.sleep(0.01)
        return {"epoch": self.epoch, "item": index}


def test_each_batch_reads_its_own_epoch_in_workers_running_ahead():
    chain = EpochChain(ResumableSampler(8, seed=1), 2)
    keys = LoaderKeys(chain)
    loader = torch.utils.data.DataLoader(
        EpochIndexed(EpochProbe()), batch_sampler=keys, num_workers=2, prefetch_factor=4,
        persistent_workers=True, multiprocessing_context="fork",
    )  # fmt: skip

    def produce(start):
        keys.start_with(start)
        for batch in loader:
            yield keys.tags.popleft(), batch

    feed = Feed(produce, CPU, chain.per_epoch, depth=4)
    got = take(feed, 4 * 3, (0, 2))
    assert [tag for tag, _ in got][:3] == [(0, 2), (0, 3), (1, 0)]
    for (epoch, _), batch in got:
        assert batch["epoch"].tolist() == [epoch, epoch]


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_set_epoch_reaches_persistent_workers_through_the_keys(context):
    """make_loader's workers live across epochs; the epoch set between passes travels with
    every index they are handed, whatever starts them."""
    probe = EpochProbe()
    loader, plan = make_loader(probe, 2, workers=2, shuffle=False, context=context, log=None)
    assert plan.persistent_workers and plan.context == context
    for epoch in (0, 3, 1):
        probe.set_epoch(epoch)
        assert [b["epoch"].tolist() for b in loader] == [[epoch, epoch]] * 4


def test_a_producer_error_reaches_the_training_loop(store):
    ds = CTPatchDataset(store, cache_gb=1)
    feed = feed_of(ds, "volumes", "random")
    ds.origins = ds.origins[:0]  # every index now fails inside the producer thread
    feed.begin(0, 0)
    with pytest.raises(IndexError):
        feed.next()
    feed.close()


def test_training_through_the_slot_pool_matches_the_loader(built, tmp_path):
    from test_training import config

    def run(where: str, **loader) -> tuple[list[float], list[str]]:
        lines: list[str] = []
        cfg = config(built, tmp_path / where, "ct_classifier", steps=4, amp="off", log_every=2,
                     batch_size=2)  # fmt: skip
        cfg.dataloader = cfg.dataloader.model_copy(update=loader)
        return train(cfg, log=lines.append).history, lines

    ds = CTPatchDataset(built[0], cache_gb=1)
    bare = pool_layout(ds, 0, 2)  # what the pool needs besides its slots
    slots = bare.need * bare.slot_bytes  # no more than one batch needs: its units cycle
    gb = (bare.tables + bare.staging + bare.gather + slots) / (1 << 30)
    pooled, lines = run("pool", device_cache="on", device_cache_gb=gb, sampler="random")
    assert any("a pool on cpu" in s and "slots of" in s for s in lines), lines
    loaded, _ = run("loader", device_cache="off", sampler="random", workers="0")
    np.testing.assert_allclose(pooled["loss"], loaded["loss"], rtol=1e-5)
    assert pooled["samples"] == loaded["samples"] and len(pooled["loss"]) == 4


def test_batch_ring_slots_are_written_only_after_the_reader_frees_them():
    ring = BatchRing(2, (3, 4), torch.float16)
    first, second = ring.take(), ring.take()
    assert {first, second} == {0, 1}
    t0 = time.monotonic()
    assert ring.take(wait_s=0.05) is None  # none free: fresh memory instead, after the wait
    assert ring.take(wait_s=5) is None and time.monotonic() - t0 < 1  # no waiting again
    image, release = ring.batch(first)
    image.fill_(7)
    kept = settle({"image": image, "item": torch.arange(3), RELEASE: release}, pin=False)
    assert RELEASE not in kept and ring.state.tolist()[first] == 0  # freed once copied out
    assert kept["image"].untyped_storage().data_ptr() != ring.data.untyped_storage().data_ptr()
    assert ring.take() == first  # reused: the copy the reader kept is not touched
    ring.data[first].fill_(1)
    assert torch.equal(kept["image"], torch.full((3, 4), 7, dtype=torch.float16))
    ring.give_back(second)  # a read that failed hands its slot back
    assert ring.take() == second


def test_loader_workers_reuse_batch_slots_the_feed_frees(store):
    """Workers write batches into slots made once; a consumer that frees them sees them come
    back; one that does not still gets right batches (fresh memory) after the wait."""
    ds = CTPatchDataset(store, cache_gb=1)
    slots = 5  # prefetch 4 + the one being copied out
    keys = [[(0, i) for i in range(b * BATCH, (b + 1) * BATCH)] for b in range(3 * slots)]
    loader, plan = make_loader(
        ds, BATCH, workers=1, context="fork", log=None, ring=True,
        collate_fn=ds.collate, batch_sampler=keys, pin_memory=False,
    )  # fmt: skip
    assert plan.ring and plan.prefetch_factor + 1 == slots
    assert loader.pin_memory is False and ds.batch_ring == 0  # the caller's is untouched
    assert "pinned memory: off (the training device is not CUDA)" in plan.reasons
    # pinned memory follows the training device: for CUDA the feed copies out into it
    _, cuda = make_loader(ds, BATCH, workers=1, context="fork", log=None,
                          ring=True, pin_memory=True, batch_sampler=keys)  # fmt: skip
    assert cuda.pin_memory and cuda.kwargs()["pin_memory"] is False
    assert "pinned memory: on (training on CUDA)" in cuda.reasons
    assert any("copies each batch out into pinned memory" in r for r in cuda.reasons)
    rings = set()
    for b, batch in enumerate(loader):
        rings.add(batch["image"].untyped_storage().data_ptr())
        assert batch["image"].untyped_storage().nbytes() == slots * batch["image"].nbytes
        kept = settle(batch, pin=False)
        for row in range(BATCH):
            np.testing.assert_array_equal(kept["image"][row, 0].numpy(),
                                          expected(ds, b * BATCH + row))  # fmt: skip
    assert len(rings) == 1  # one ring, mapped once, for 3 x its slots of batches

    monkey = pytest.MonkeyPatch()
    monkey.setattr(ring_module, "WAIT_S", 0.05)  # forked workers inherit it
    try:
        held = []
        loader, _ = make_loader(
            ds, BATCH, workers=1, context="fork", log=None, ring=True,
            collate_fn=ds.collate, batch_sampler=keys,
        )  # fmt: skip
        for b, batch in enumerate(loader):  # never freed: the worker falls back
            held.append(batch)
            for row in range(BATCH):
                np.testing.assert_array_equal(batch["image"][row, 0].numpy(),
                                              expected(ds, b * BATCH + row))  # fmt: skip
        assert sum(RELEASE in batch for batch in held) == slots
    finally:
        monkey.undo()


def test_a_model_on_the_cpu_gets_the_cpus_its_loader_workers_leave(monkeypatch):
    """torch's default (a thread per CPU) spins against the loader workers when the model
    trains on the CPU; the plan gives the model what the workers leave, at least one
    thread, and a set ``OMP_NUM_THREADS`` wins."""
    from zarrfeed.processes import usable_cpus
    from zarrfeed.training.data.facts import world_facts
    from zarrfeed.training.data.plan import plan_threads

    def share_cpus(workers: int) -> str:  # what the feed does with the plan
        threads, line = plan_threads(machine_facts(), world_facts(), workers)
        if threads is not None:
            torch.set_num_threads(threads)
        return line

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(usable_cpus())
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        line = share_cpus(usable_cpus())  # the workers take every CPU: the model keeps one
        assert torch.get_num_threads() == 1 and line.startswith("intra-op threads: 1 "), line
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks here share the CPUs
        torch.set_num_threads(usable_cpus())
        share_cpus(0)
        assert torch.get_num_threads() == max(1, usable_cpus() // 2)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        assert share_cpus(usable_cpus()) == "intra-op threads: 3 (OMP_NUM_THREADS)"
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
