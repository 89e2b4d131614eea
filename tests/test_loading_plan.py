"""The loading plan as a pure function: every branch of it and the reason it gives, from
facts written down here (no dataset, no DataLoader, no device)."""

from __future__ import annotations

import pytest

from zarrfeed.errors import ConfigError
from zarrfeed.training.data.device import PoolFacts, layout_pool
from zarrfeed.training.data.facts import Budgets, CacheFacts, DataFacts, Machine, World
from zarrfeed.training.data.plan import (
    DEVICE_SHARE,
    IN_FLIGHT_SHARE,
    device_budget,
    plan_loading,
    plan_threads,
    preloaded,
    started,
)

GB = 1 << 30
UNIT = 64**3 * 2  # one 64³ float16 cache unit
POOL = PoolFacts(UNIT, 96, 8, 3, 0, 8, 32**3, True)
MACHINE = Machine(40, "test", 64 * GB, False, "cpu", 0, 40)
CUDA = Machine(40, "test", 64 * GB, True, "cuda:0", 80 * GB, 40)
WORLD = World()


def ram(nbytes: int = 1 * GB, budget: int = 2 * GB) -> CacheFacts:
    return CacheFacts(True, nbytes, budget, budget, "in RAM (whole arrays)")


def ooc(nbytes: int = 4 * GB, budget: int = 1 * GB) -> CacheFacts:
    return CacheFacts(False, nbytes, budget, budget, "out of core (0.50 MiB units)")


def data(cache: CacheFacts | None = None, **kw) -> DataFacts:
    kw = {"name": "Probe", "samples": 10_000, "sample_bytes": 1 << 20, "cache": cache} | kw
    return DataFacts(**kw)


def patches(cache: CacheFacts, **kw) -> DataFacts:
    """A patch dataset the device tier can cut."""
    return data(cache, **({"device_refusal": None, "pool": POOL, "worker_configurable": True} | kw))


def plan(facts: DataFacts, machine: Machine = MACHINE, world: World = WORLD, **budgets):
    return plan_loading(facts, machine, world, Budgets(**({"batch_size": 8} | budgets)))


# the device tier ---------------------------------------------------------------------------
def test_a_plain_loader_has_no_device_tier_and_no_device_reason():
    p = plan(patches(ram()))
    assert p.tier == "loader" and p.device_reasons == [] and p.thread_reasons == []


@pytest.mark.parametrize(
    ("facts", "mode", "machine", "why"),
    [
        (patches(ram()), "off", CUDA, "device cache: off (as configured)"),
        (data(ram(), device_refusal="it cuts CT patches only; Clips"), "on", CUDA,
         "device cache: off (it cuts CT patches only; Clips)"),
        (patches(ram()), "auto", MACHINE, "device cache: off (auto: cpu is not a CUDA device)"),
    ],
)  # fmt: skip
def test_the_device_tier_is_off_with_its_reason(facts, mode, machine, why):
    p = plan(facts, machine, device_cache=mode)
    assert p.tier == "loader" and p.device_reasons == [why]
    assert p.loader.num_workers > 0  # the DataLoader serves the batches


def test_volumes_that_fit_the_device_budget_are_held_there():
    p = plan(patches(ram(1 * GB)), CUDA, device_cache="auto")
    budget = int(DEVICE_SHARE * 80 * GB)
    assert p.tier == "volumes" and p.device_budget == budget
    assert p.device_reasons == [
        f"device cache: volumes held on cuda:0 (1.07 GB <= {DEVICE_SHARE:g} x 85.9 GB free on "
        "cuda:0)"
    ]
    assert p.loader.num_workers == 0 and p.loader.context is None
    assert p.order.kind == "shuffle" and "(the batches are cut on the device)" in p.order.reason
    assert p.order_reasons[-1].startswith("batches are cut on the device by one gather")
    assert p.preload and p.cache_reasons[0].startswith("cache: preloaded 1.07 GB decoded")


def test_a_slot_pool_when_the_volumes_do_not_fit_with_a_block_order_sized_to_it():
    bare = layout_pool(POOL, 0, 8)
    gb = (bare.tables + bare.staging + bare.gather + 80 * UNIT) / GB  # a batch needs 64
    p = plan(patches(ooc(4 * GB, 1 * GB)), MACHINE, device_cache="on", device_cache_gb=gb)
    layout = layout_pool(POOL, int(gb * GB), 8)
    assert p.tier == "slots" and layout.describe() in p.device_reasons[0]
    assert "do not fit" in p.device_reasons[0] and "least recently used" in p.device_reasons[0]
    block = min(1 * GB, layout.slot_total) // 2
    assert p.order.kind == "block" and p.order.block_bytes == block
    assert "half the smaller of the" in p.order.reason and not p.preload
    random = plan(patches(ooc()), MACHINE, device_cache="on", device_cache_gb=gb, order="random")
    assert random.order.kind == "shuffle" and "(the batches are cut in device slots)" in (
        random.order.reason
    )
    block_asked = plan(patches(ooc()), MACHINE, device_cache="on", device_cache_gb=gb,
                       order="block")  # fmt: skip
    assert block_asked.order.kind == "block" and block_asked.order.block_bytes is None


def test_no_pool_when_a_batch_needs_more_units_than_the_budget_holds_or_units_differ():
    small = layout_pool(POOL, 0, 8)
    gb = (small.tables + small.staging + small.gather + 63 * UNIT) / GB  # a batch needs 64
    p = plan(patches(ooc()), MACHINE, device_cache="on", device_cache_gb=gb)
    assert p.tier == "loader" and "a batch may need 64 units" in p.device_reasons[0]
    odd = patches(ooc(), pool=PoolFacts(UNIT, 96, 8, 3, 0, 8, 32**3, False))
    p = plan(odd, MACHINE, device_cache="on", device_cache_gb=3.0)
    assert p.tier == "loader" and "scans have different cache units" in p.device_reasons[0]


def test_the_device_budget_is_configured_or_a_share_of_free_memory():
    assert device_budget(MACHINE, 0.5) == (GB // 2, "0.5 GiB as configured")
    assert device_budget(CUDA, None)[0] == int(DEVICE_SHARE * 80 * GB)
    budget, how = device_budget(MACHINE, None)
    assert budget == int(DEVICE_SHARE * 64 * GB) and "available RAM" in how


# the cache ---------------------------------------------------------------------------------
def test_the_cache_is_preloaded_when_it_fits_else_filled_on_demand_or_out_of_core():
    p = plan(data(ram()))
    assert p.preload and p.cache_reasons == ["cache: preloaded 1.07 GB decoded, cache budget "
                                             "2.15 GB"]  # fmt: skip
    preloaded(p, 1.25)
    assert p.cache_reasons == ["cache: preloaded 1.07 GB decoded, cache budget 2.15 GB in 1.2s"]
    p = plan(data(ram()), preload=False)
    assert not p.preload and p.cache_reasons[0].endswith(": filled on demand")
    p = plan(data(ooc()), preload=True)
    assert not p.preload
    assert p.cache_reasons == [
        "cache: 4.29 GB decoded, cache budget 1.07 GB: out of core (0.50 MiB units), "
        "1.07 GB of slots (preload skipped: it does not fit)"
    ]
    assert plan(data(None)).cache_reasons == [] and not plan(data(None)).preload


# the epoch order ---------------------------------------------------------------------------
def test_a_plain_loader_block_shuffles_beyond_ram_and_shuffles_whole_otherwise():
    p = plan(data(ooc()))
    assert p.order.kind == "block" and "(auto: 4.29 GB decoded > 1.07 GB cache budget)" in (
        p.order.reason
    )
    assert p.order_reasons == [f"sampler: {p.order.reason}"]
    p = plan(data(ram()))
    assert p.order is None and p.random_order
    assert p.order_reasons == ["sampler: shuffled over the whole dataset, a new order every epoch"]
    p = plan(data(ram()), order="block")
    assert p.order.kind == "block" and "auto" not in p.order.reason
    p = plan(data(ooc()), order="random")
    assert p.order is None and p.random_order
    p = plan(data(ram()), shuffle=False)
    assert p.order is None and not p.random_order and p.order_reasons == []
    with pytest.raises(ValueError, match="order must be 'auto', 'block' or 'random'"):
        plan(data(ram()), order="sorted")
    with pytest.raises(ValueError, match="Probe has no cache to block-shuffle for"):
        plan(data(None), order="block", device_cache="off")


def test_a_given_sampler_is_kept_and_its_reason_logged():
    p = plan(data(ooc()), given_sampler="my own order")
    assert p.order is None and not p.random_order
    assert p.order_reasons == ["sampler: my own order"]
    assert plan(data(ooc()), given_sampler="").order_reasons == []


def test_the_feed_walks_a_resumable_order_of_its_own():
    p = plan(data(ram()), device_cache="off")
    assert p.order.kind == "shuffle" and "(auto: the dataset fits its 2.15 GB cache)" in (
        p.order.reason
    )
    assert plan(data(ooc()), device_cache="off").order.kind == "block"


# workers, prefetch, pinning, batch slots ---------------------------------------------------
def test_workers_follow_cpus_ranks_dataset_size_and_spec():
    facts = data(None, sample_bytes=0)
    assert plan(facts).loader.num_workers == 32  # seed 001: 40 CPUs → 32
    assert "workers: 32 from auto = 0.8 x 40 CPUs / 1 ranks" in plan(facts).loader.reasons
    assert plan(facts, workers="cpu*0.9").loader.num_workers == 36
    assert plan(facts, world=World(local=3)).loader.num_workers == 10
    small = plan(data(None, samples=20, sample_bytes=0), batch_size=2).loader
    assert small.num_workers == 2 and any("small dataset" in r for r in small.reasons)
    few = plan(data(None, samples=300, sample_bytes=0), batch_size=100).loader
    assert few.num_workers == 3 and "capped at 3: one batch per worker at most" in few.reasons
    assert plan(facts, workers=5).loader.num_workers == 5
    assert "workers: 5 (as configured)" in plan(facts, workers="5").loader.reasons
    none = plan(facts, workers=0).loader
    assert none.context is None and none.prefetch_factor is None and not none.persistent_workers
    with pytest.raises(ValueError, match="'auto', 'cpu\\*<fraction>' or an integer"):
        plan(facts, workers="many")
    assert plan(facts).loader.prefetch_factor == 4
    assert plan(facts, train=False).loader.prefetch_factor == 2


def test_workers_are_capped_by_the_memory_left_after_the_cache():
    tight = Machine(40, "test", 2 * GB + 700 * (1 << 20), False)
    p = plan(data(ram(1 * GB, 2 * GB)), tight).loader
    assert p.num_workers == 2 and any("MiB free after the cache" in r for r in p.reasons)


def test_batches_in_flight_fit_their_share_of_an_out_of_core_budget():
    batch = 8 << 20
    budget = int((2 + 2 + 4) * batch / IN_FLIGHT_SHARE)  # 2 held + 6 prefetched
    p = plan(data(ooc(8 * budget, budget)), workers=2).loader
    assert (p.num_workers, p.prefetch_factor) == (2, 3)
    assert any("batches in flight kept within" in r for r in p.reasons)
    with pytest.raises(ConfigError, match="the smallest cache_gb that works is"):
        plan(data(ooc(8 * GB, 10 * batch)), workers=2)


def test_batch_slots_need_a_configurable_dataset_and_in_the_feed_a_collate_that_hands_on():
    facts = data(ram(), worker_configurable=True)
    assert plan(facts, workers=2, ring=True).loader.ring
    assert not plan(data(ram()), workers=2, ring=True).loader.ring
    assert not plan(facts, workers=2, device_cache="off").loader.ring  # default_collate copies
    hands_on = data(ram(), worker_configurable=True, hands_on=True)
    feed = plan(hands_on, workers=2, device_cache="off", pin_memory=True).loader
    assert feed.ring and feed.shared_batches and feed.kwargs()["pin_memory"] is False
    assert any("copies each batch out into pinned memory" in r for r in feed.reasons)


def test_pinned_memory_follows_cuda_or_the_training_device():
    assert "pinned memory: off (no CUDA)" in plan(data(None)).loader.reasons
    assert "pinned memory: on (CUDA present)" in plan(data(None), CUDA).loader.reasons
    on = plan(data(None), pin_memory=True).loader
    assert on.pin_memory and "pinned memory: on (training on CUDA)" in on.reasons
    off = plan(data(None), CUDA, pin_memory=False).loader
    assert "pinned memory: off (the training device is not CUDA)" in off.reasons


# threads and the order of the reasons ------------------------------------------------------
def test_a_model_on_the_cpu_gets_the_threads_its_workers_leave():
    threads, line = plan_threads(MACHINE, World(), 4)
    assert threads == 36 and line.startswith("intra-op threads: 36 (the model trains on the CPU")
    assert plan_threads(MACHINE, World(local=2), 30) == (
        1, "intra-op threads: 1 (the model trains on the CPU: 40 CPUs, 2 rank(s) here, "
        "30 loader workers each)"
    )  # fmt: skip
    few = Machine(40, "test", 64 * GB, False, torch_threads=2)
    assert plan_threads(few, World(), 4)[0] is None  # never more than torch has
    omp = Machine(40, "test", 64 * GB, False, torch_threads=3, omp_threads=True)
    assert plan_threads(omp, World(), 4) == (None, "intra-op threads: 3 (OMP_NUM_THREADS)")
    p = plan(data(ram()), device_cache="off", workers=4)
    assert p.threads == 36 and p.thread_reasons[0].startswith("intra-op threads: 36")
    cuda = plan(data(ram()), CUDA, device_cache="off", workers=4)
    assert cuda.threads is None and cuda.thread_reasons == []


def test_the_reasons_come_in_the_order_the_log_prints_them():
    p = plan(data(ram()), device_cache="off", workers=2)
    started(p, "fork (as configured)")
    lines = p.reasons()
    assert lines[0] == "device cache: off (as configured)"
    assert lines[1].startswith("CPUs usable: 40 (test); local world size: 1")
    kinds = ["device", "CPUs", "dataset", "workers", "pinned", "cache", "sampler", "start",
             "intra-op"]  # fmt: skip
    assert [k for k in kinds if any(line.startswith(k) for line in lines)] == kinds
    firsts = [next(i for i, line in enumerate(lines) if line.startswith(k)) for k in kinds]
    assert firsts == sorted(firsts)
    assert lines[-2] == "start method: fork (as configured)"
