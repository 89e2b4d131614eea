"""A value that belongs to one process: built on first use in each process, built again in a
forked child, and never pickled.

Handles — descriptors, mappings, thread pools, clients, thread locks — are per process.  A
forked child inherits copies of its parent's that it must not use as its own: a lock taken
through an inherited descriptor is held for the parent too, a pool's threads did not survive
the fork, a thread lock may have been held by a thread that is gone.  :class:`ProcessLocal`
keeps the pid a value was built in, builds a new one wherever that is not this process, and
hands what a forked child inherited to a hook first (which closes the copies of descriptors,
say, without unlocking what the parent holds through them).

A forked child also inherits its parent's asyncio event loops (zarr's and fsspec's I/O loops
behind an object store), and an epoll descriptor names one kernel object in both processes.
When the child's garbage collector finalises an inherited HTTP connection (aiohttp closes
its transport), the loop deregisters the socket from that shared epoll instance: the
parent's loop then never hears its pooled connection's reply and waits out the read
timeout (measured: a write after forked loader workers stalled 120 s on S3).
:func:`private_event_polls` runs in every forked child and gives each inherited epoll
descriptor a fresh, empty instance of its own.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_FDS = "/proc/self/fd"


class ProcessLocal(Generic[T]):
    """``build()`` once per process.

    ``inherited`` is given a value built in another process (the parent of a fork) before
    this process builds its own; ``guard`` (a function returning a context manager, such as
    a lock) is held while a value is built, so that threads of one process build one value.
    Pickles without its value: what arrives in another process builds its own there.
    """

    def __init__(
        self,
        build: Callable[[], T],
        inherited: Callable[[T], object] | None = None,
        guard: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        self._build, self._inherited, self._guard = build, inherited, guard
        self._pid = -1
        self._value: T | None = None

    def get(self) -> T:
        """This process's value, built now if it has none."""
        if self._pid == os.getpid():
            return self._value  # type: ignore[return-value]
        if self._guard is None:
            return self._make()
        with self._guard():
            if self._pid == os.getpid():  # another thread built it meanwhile
                return self._value  # type: ignore[return-value]
            return self._make()

    def _make(self) -> T:
        parent, self._pid, self._value = self._value, -1, None
        if parent is not None and self._inherited is not None:
            self._inherited(parent)
        value = self._build()
        self._value, self._pid = value, os.getpid()
        return value

    def peek(self) -> T | None:
        """This process's value if it has built one, else None (builds nothing)."""
        return self._value if self._pid == os.getpid() else None

    def discard(self) -> T | None:
        """Forget this process's value (the next :meth:`get` builds another) and return it,
        for its owner to dispose of; None when this process has none."""
        if self._pid != os.getpid():
            return None
        value, self._value, self._pid = self._value, None, -1
        return value

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_value": None}


def private_event_polls() -> int:
    """Point every epoll descriptor of this process at a new, empty epoll instance, and
    return how many there were (Linux; elsewhere 0).

    Run in a forked child before anything else, it cuts the inherited event loops off the
    parent's: whatever they register or remove from then on (the finaliser of an inherited
    connection, say) changes the child's copy only.  The loops themselves are never run in
    the child — their threads did not survive the fork — so nothing waits on them."""
    if not os.path.isdir(_FDS):
        return 0
    polls = []
    for name in os.listdir(_FDS):
        try:
            if os.readlink(f"{_FDS}/{name}") == "anon_inode:[eventpoll]":
                polls.append(int(name))
        except OSError:  # the listing's own descriptor, closed as the listing ended
            continue
    for fd in polls:
        fresh = select.epoll()
        try:
            os.dup2(fresh.fileno(), fd, inheritable=False)  # close-on-exec, as before
        finally:
            fresh.close()
    return len(polls)


os.register_at_fork(after_in_child=private_event_polls)
