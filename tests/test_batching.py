"""The batching rule: partitions per run, partitions in flight, run ranges."""

import itertools

from zarrfeed.batching import MAX_PER_RUN, MIN_PER_RUN, in_flight, per_run, ranges

GB = 1 << 30


def test_runs_grow_with_the_cores_within_their_bounds():
    sizes = [per_run(c) for c in (0, 1, 2, 4, 16, 64, 1024)]
    assert sizes == sorted(sizes)
    assert min(sizes) == MIN_PER_RUN and max(sizes) == MAX_PER_RUN
    assert per_run(16) > per_run(2) >= 2 * 2  # several rounds of the cores per run


def test_in_flight_follows_the_cores_unless_memory_or_the_run_is_smaller():
    assert in_flight(16, 64 * GB, GB, 100) == 16
    assert in_flight(2, 64 * GB, GB, 100) == 2
    assert in_flight(16, 8 * GB, GB, 100) < 16  # 1 GB items in 8 GB: memory bounds it
    assert in_flight(16, 64 * GB, GB, 3) == 3  # never more than the run holds
    assert in_flight(16, 0, GB, 100) == 1  # no memory left: still one at a time
    for cpus, memory, item in itertools.product((1, 2, 16), (GB, 8 * GB), (1, GB // 4, 2 * GB)):
        n = in_flight(cpus, memory, item, 64)
        assert 1 <= n <= cpus
        assert n == 1 or n * item <= memory  # the ones in flight fit in the memory


def test_ranges_cover_exactly_the_wanted_keys_in_consecutive_stretches():
    order = [f"k{i:02d}" for i in range(20)]
    wanted = {"k00", "k01", "k02", "k05", "k06", "k07", "k08", "k09", "k19", "zz"}
    runs = ranges(order, wanted, 3)
    assert sorted(k for run in runs for k in run) == sorted(wanted - {"zz"})
    for run in runs:
        assert 1 <= len(run) <= 3
        start = order.index(run[0])
        assert run == order[start : start + len(run)]  # a range holds no unwanted key
    assert runs == [["k00", "k01", "k02"], ["k05", "k06", "k07"], ["k08", "k09"], ["k19"]]
    assert ranges(order, [], 3) == []
    assert ranges(order, order, 50) == [order]
