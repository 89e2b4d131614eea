"""ProcessLocal: one value per process, rebuilt in a forked child, never pickled."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import socket
import threading

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


def _is_epoll(fd: int) -> bool:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventpoll]"
    return False


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


def test_a_forked_child_cannot_deregister_its_parents_sockets():
    """An inherited event loop that drops a socket in the child (what the finaliser of an
    inherited HTTP connection does) leaves the parent's loop watching it: epoll is one
    kernel object in both processes unless the child gets its own."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    ours, theirs = socket.socketpair()
    heard = threading.Event()
    ready = threading.Event()

    def watch() -> None:
        loop.add_reader(ours.fileno(), heard.set)
        ready.set()

    loop.call_soon_threadsafe(watch)
    assert ready.wait(5)
    try:

        def drop() -> bool:
            loop.remove_reader(ours.fileno())  # the inherited loop's thread is gone here
            fds = [int(n) for n in os.listdir("/proc/self/fd")]
            polls = [fd for fd in fds if _is_epoll(fd)]
            return bool(polls) and not any(map(os.get_inheritable, polls))  # close-on-exec

        assert _in_child(drop) == 0
        theirs.send(b"x")
        assert heard.wait(5), "the parent's loop stopped watching its socket after a fork"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        ours.close()
        theirs.close()
