"""Items built in worker processes: each on its own, a dead worker failing only its item."""

import pool_tasks
import pytest

from zarrfeed.batching import PROCESS_ITEM_BYTES, worker_processes
from zarrfeed.workerpool import run_in_processes


def build(keys: list[str], workers: int) -> tuple[dict, dict, list[str]]:
    done, errors, order = {}, {}, []

    def finished(key: str, result: object, error: str | None) -> None:
        order.append(key)
        if error is None:
            done[key] = result
        else:
            errors[key] = error

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


def test_only_large_items_built_several_at_once_go_to_worker_processes():
    assert worker_processes(2, PROCESS_ITEM_BYTES)
    assert not worker_processes(1, PROCESS_ITEM_BYTES)  # one at a time: threads
    assert not worker_processes(2, PROCESS_ITEM_BYTES - 1)  # small items: threads
