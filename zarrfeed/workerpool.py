"""Items built one per worker process, a few processes at a time, each item on its own.

Threads share one interpreter lock: the parts of a build that hold it (Python around the
array work, previews, percentiles, decoding loops) run one at a time however many threads
there are, and the process that records the results competes for it too.  Worker processes
run those parts side by side.  Only the task's name, a small job description and the keys
travel to a worker; it reads and writes the data itself and sends back what it reports.

Each worker builds one key at a time and answers ``(key, result, error)``.  A worker that
dies (killed, out of memory, a crash in native code) fails the key it was building, named,
and a new worker takes the keys still waiting: no death stops the others.  Workers start
from a fork server (never a fork of this process, which may hold threads and locks) that
imports the heavy modules once, so a worker starts in milliseconds after the first.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import platform
import signal
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

# What the fork server imports once for every worker: numpy, torch and the build code take
# ~2 s of CPU to import, which a worker started from a bare interpreter would pay each time.
PRELOAD = ("__main__", "numpy", "torch", "zarrfeed.assets.workers")

Task = Callable[[Any, str], Any]  # (job, key) -> result; module-level, so it pickles by name
Finished = Callable[[str, Any, str | None], None]  # (key, result, error)


def start_problem() -> str | None:
    """Why worker processes cannot start here, or None: no fork server on this platform,
    this process is a daemon (a pool worker of another library, which may not have
    children), or its main script would be re-run in every worker (top-level code outside
    ``if __name__ == "__main__":``)."""
    if "forkserver" not in mp.get_all_start_methods():
        return "this platform has no fork server to start worker processes from"
    if mp.current_process().daemon:
        return "this process is a daemonic process, which may not start processes"
    from zarrfeed.training.data.start import rerun_problem

    return rerun_problem()


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    return ctx


def warm_up() -> None:
    """Start the fork server now, so that its imports overlap what this process does before
    it first needs a worker (they take ~2 s, which the first workers would wait for)."""
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Have this process reuse the memory its items free instead of handing it back (glibc
    only; False elsewhere, where nothing changes).

    glibc maps each large array (a CT volume: hundreds of MB) afresh and unmaps it when
    freed, so every item faults in new pages that the kernel zeroes again, and a virtual
    machine that returns freed memory to its host has the host back them again.  Served
    from the heap (no mmap) and never trimmed, the next item reuses the pages in place (a
    CT scan's build: ~55,000 page faults → a few hundred, 0.3 → 0.17 s of system time).
    A worker builds items one after another and exits after its step, so what it keeps is
    its own peak.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, -1))


def _serve(conn: Connection, task: Task, job: Any) -> None:
    """A worker: build each key the owner sends until it closes the connection."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides what an interrupt stops
    keep_freed_memory()
    while True:
        try:
            key = conn.recv()
        except (EOFError, OSError):
            return  # the owner is gone or done
        try:
            answer = (key, task(job, key), None)
        except Exception as exc:  # a task's own errors are its answers; this is a bug
            answer = (key, None, "".join(traceback.format_exception(exc)))
        try:
            conn.send(answer)
        except (BrokenPipeError, EOFError, OSError):
            return
        except Exception as exc:  # an unpicklable result
            conn.send((key, None, f"its result could not be sent back: {exc!r}"))


def death(process: BaseProcess) -> str:
    """How a worker process ended, in words."""
    code = process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        why = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"the worker process building it was killed by {name}{why}"
    return f"the worker process building it exited with code {code}"


class _Worker:
    def __init__(self, ctx: mp.context.BaseContext, task: Task, job: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, task, job), daemon=True)
        self.process.start()
        child.close()
        self.key: str | None = None

    def give(self, key: str) -> None:
        self.key = key
        self.conn.send(key)

    def stop(self, kill: bool = False) -> None:
        self.conn.close()
        if kill:
            self.process.kill()
        self.process.join(None if kill else 30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def run_in_processes(
    keys: Sequence[str],
    task: Task,
    job: Any,
    workers: int,
    finished: Finished,
    where: Callable[[str], str] = str,
) -> None:
    """``task(job, key)`` for each of ``keys`` on ``workers`` worker processes, calling
    ``finished(key, result, error)`` in this thread as each ends (``error``: why it failed,
    naming ``where(key)`` when its worker died).  An interrupt kills the workers (what they
    were building is never committed: a commit is one atomic write) and is raised again."""
    ctx = _context()
    waiting = deque(keys)
    pool: list[_Worker] = []

    def assign(worker: _Worker) -> None:
        """The next waiting key to ``worker`` (to a new worker if it died meanwhile)."""
        while waiting:
            key = waiting.popleft()
            try:
                worker.give(key)
                return
            except OSError:  # it died after its last answer
                worker.key = None  # (its end may be ready in this wait too: not this key's)
                waiting.appendleft(key)
                pool.remove(worker)
                worker.stop(kill=True)
                worker = _Worker(ctx, task, job)
                pool.append(worker)

    try:
        for _ in range(min(max(1, workers), len(keys))):
            pool.append(_Worker(ctx, task, job))
            assign(pool[-1])
        while busy := [w for w in pool if w.key is not None]:
            by_handle = {h: w for w in busy for h in (w.conn, w.process.sentinel)}
            for ready in wait(list(by_handle)):
                worker = by_handle[ready]
                key = worker.key
                if key is None:
                    continue  # its answer and its end were both ready: handled
                worker.key = None
                try:
                    got, result, error = worker.conn.recv()
                except (EOFError, OSError):
                    worker.process.join(5)
                    got, result, error = key, None, f"{where(key)}: {death(worker.process)}"
                    pool.remove(worker)
                    worker.stop(kill=True)
                    if waiting:
                        worker = _Worker(ctx, task, job)
                        pool.append(worker)
                if got != key:
                    raise RuntimeError(f"a worker answered for {got!r} while building {key!r}")
                assign(worker)
                finished(key, result, error)
    except BaseException:
        for worker in pool:
            worker.stop(kill=True)
        raise
    for worker in pool:
        worker.stop()
