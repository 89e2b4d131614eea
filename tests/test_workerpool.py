"""Items built in worker processes: each on its own, a dead worker failing only its item."""

import platform
import resource
import time
from collections.abc import Callable

import pool_tasks
import pytest

from zarrfeed.batching import PROCESS_ITEM_BYTES, worker_processes
from zarrfeed.workerpool import run_in_processes


def build(
    keys: list[str], workers: int, busy: Callable[[str], None] = lambda key: None
) -> tuple[dict, dict, list[str]]:
    """What ``square_or_fail`` built, the errors, the order keys ended in; ``busy(key)``:
    the owner's own work after each key ends."""
    done, errors, order = {}, {}, []

    def finished(key: str, result: object, error: str | None) -> None:
        order.append(key)
        if error is None:
            done[key] = result
        else:
            errors[key] = error
        busy(key)

    where = lambda key: f"item {key}"  # noqa: E731
    run_in_processes(keys, pool_tasks.square_or_fail, 10, workers, finished, where)
    return done, errors, order


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dead_worker_fails_its_item_alone_and_the_others_still_build(workers):
    keys = ["1", "exit", "2", "kill", "raise", "3"]
    done, errors, order = build(keys, workers)
    assert sorted(order) == sorted(keys)  # every item answered once, none waited forever
    assert done == {"1": 10, "2": 40, "3": 90}
    assert errors["exit"] == "item exit: the worker process building it exited with code 3"
    assert errors["kill"] == (
        "item kill: the worker process building it was killed by SIGKILL (out of memory?)"
    )
    assert "RuntimeError: a bug in the task" in errors["raise"]


def test_a_worker_that_answered_and_died_while_the_owner_was_busy_fails_nothing_else():
    """Its answer and its death are seen in one wait, after a key was handed to it (and so
    to a new worker): the new worker's key is built, not failed, and nothing crashes."""

    def busy(key: str) -> None:
        if key == "answer-then-die":
            time.sleep(1.5)  # meanwhile: it answers "1", then is killed

    keys = ["answer-then-die", "1", "2"]
    done, errors, order = build(keys, 1, busy)
    assert sorted(order) == sorted(keys)
    assert done == {"answer-then-die": 0, "1": 10, "2": 40}, errors


def test_only_large_items_built_several_at_once_go_to_worker_processes():
    assert worker_processes(2, PROCESS_ITEM_BYTES)
    assert not worker_processes(1, PROCESS_ITEM_BYTES)  # one at a time: threads
    assert not worker_processes(2, PROCESS_ITEM_BYTES - 1)  # small items: threads


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_worker_reuses_the_memory_its_items_freed():
    """The second item's arrays land in pages the first one freed: no new page faults, where
    a default process would fault in (and have zeroed) every page again."""
    got: dict[str, int] = {}
    size = 256 << 20
    run_in_processes(["1", "2"], pool_tasks.page_faults_of_an_array, size, 1,
                     lambda key, faults, error: got.__setitem__(key, faults))  # fmt: skip
    pages = size // resource.getpagesize()
    assert got["1"] > pages // 1024  # the first item faults its pages in (huge pages or not)
    assert got["2"] < got["1"] // 10, got
    assert pool_tasks.page_faults_of_an_array(size, "") > pages // 1024  # here: every time
    assert pool_tasks.page_faults_of_an_array(size, "") > pages // 1024
