"""ProcessLocal: one value per process, rebuilt in a forked child, never pickled."""

from __future__ import annotations

import contextlib
import os
import pickle

from zarrfeed.processlocal import ProcessLocal


def _in_child(check) -> int:
    """Run ``check()`` in a forked child: its exit code (0 when it returned True)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if check() else 1)
        except BaseException:
            os._exit(2)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_value_is_built_once_per_process():
    built = []
    local = ProcessLocal(lambda: built.append(1) or object())
    assert local.peek() is None and not built
    first = local.get()
    assert local.get() is first and local.peek() is first and built == [1]


def test_a_forked_child_builds_its_own_after_disposing_of_the_parents():
    disposed: list[object] = []
    local = ProcessLocal(object, inherited=disposed.append)
    parent = local.get()

    def check() -> bool:
        assert local.peek() is None  # the inherited value is not this process's
        mine = local.get()
        return mine is not parent and disposed == [parent] and local.get() is mine

    assert _in_child(check) == 0
    assert local.get() is parent and disposed == []  # the parent's is untouched


def test_discard_forgets_the_value_and_hands_it_back():
    local = ProcessLocal(object)
    first = local.get()
    assert local.discard() is first and local.peek() is None
    assert local.discard() is None
    assert local.get() is not first


def test_the_guard_is_held_while_building():
    held, seen = [], []

    @contextlib.contextmanager
    def guard():
        held.append(1)
        yield
        held.pop()

    local = ProcessLocal(lambda: seen.append(len(held)) or 1, guard=guard)
    local.get()
    local.get()  # built already: no guard taken
    assert seen == [1] and not held


def test_pickling_drops_the_value():
    local = ProcessLocal(dict)
    local.get()["handle"] = 42
    copy = pickle.loads(pickle.dumps(local))
    assert copy.peek() is None and copy.get() == {}
