"""The eviction policy every cache tier uses, on its own."""

from __future__ import annotations

import numpy as np

from zarrfeed.eviction import victims


def test_least_recently_used_go_first_as_many_as_needed():
    used = np.array([50, 10, 40, 20, 30])
    assert victims(used, 2).tolist() == [1, 3]
    assert victims(used, 9).tolist() == [1, 3, 4, 2, 0]  # all there is
    assert victims(used, 0).tolist() == []


def test_bytes_needed_take_the_fewest_oldest_entries_that_free_them():
    used = np.array([3, 1, 2, 4])
    sizes = np.array([100, 10, 50, 1])
    assert victims(used, 10, sizes=sizes).tolist() == [1]
    assert victims(used, 11, sizes=sizes).tolist() == [1, 2]
    assert victims(used, 60, sizes=sizes).tolist() == [1, 2]
    assert victims(used, 1000, sizes=sizes).tolist() == [1, 2, 0, 3]


def test_protected_entries_are_never_chosen():
    used = np.array([1, 2, 3, 4])
    writing = np.array([True, False, True, False])
    assert victims(used, 3, protected=writing).tolist() == [1, 3]
    sizes = np.array([5, 5, 5, 5])
    assert victims(used, 8, sizes=sizes, protected=writing).tolist() == [1, 3]


def test_a_lower_priority_goes_before_any_higher_one():
    used = np.array([1, 2, 3, 4])
    kept = np.array([True, False, True, False])  # read by the next block: evicted last
    assert victims(used, 3, priority=kept).tolist() == [1, 3, 0]


def test_a_sample_of_a_large_set_still_evicts_old_entries():
    rng = np.random.default_rng(0)
    used = rng.permutation(100_000)
    chosen = victims(used, 10, sample=4096, rng=rng)
    assert len(chosen) == 10 and len(set(chosen.tolist())) == 10
    assert np.all(used[chosen] < 1_000)  # among the oldest 1 % (a sample of 4 % sees ~40)
    assert np.all(np.diff(used[chosen]) > 0)  # in eviction order
