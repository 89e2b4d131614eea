"""How DataLoader workers start: a method that works where the loader is made.

forkserver and spawn workers begin by re-running the main script (as ``__mp_main__``) so that
what it defines can be unpickled.  A script that makes its loader at its top level, with no
``if __name__ == "__main__":`` guard, would make it again in every worker, which Python stops
with "An attempt has been made to start a new process before the current process has finished
its bootstrapping phase".  Interactive sessions (a notebook, ``python -c``) and a package's
``__main__`` are never re-run, so the functions they define (a transform) cannot reach such
workers at all.  fork copies the running process instead and needs neither; zarrfeed's
datasets are safe to fork: they open the store again in each process (zarr-python resets its
I/O loop after a fork) and their caches are shared-memory files that every process maps.
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import pickle
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from zarrfeed.errors import ConfigError

START_METHODS = ("auto", "fork", "forkserver", "spawn")
_FIX = 'put the loader code under `if __name__ == "__main__":`'


def start_method(requested: str = "auto", dataset: Any = None) -> tuple[str, str]:
    """(method, why) for ``requested``.

    "auto" takes forkserver (no inherited threads or locks) where its workers can import the
    caller's ``__main__`` without re-running the caller and find what ``dataset`` refers to
    there, else fork.  An explicit forkserver or spawn that cannot work fails in one line
    naming the fix.
    """
    if requested not in START_METHODS:
        raise ConfigError(f"start method must be one of {', '.join(START_METHODS)}: {requested!r}")
    if requested == "fork":
        return "fork", "fork (as configured)"
    problem = rerun_problem() or _unreachable_problem(dataset)
    if problem is None:
        how = "as configured" if requested != "auto" else "auto: nothing in __main__ re-runs"
        return ("forkserver" if requested == "auto" else requested), f"{requested} ({how})"
    if requested != "auto":
        raise ConfigError(f"context={requested!r} cannot start workers here: {problem}")
    if "fork" not in mp.get_all_start_methods():
        raise ConfigError(f"no start method can start workers here: {problem}")
    return "fork", f"fork (auto: {problem.split(': ')[0]})"


def rerun_problem() -> str | None:
    """What goes wrong when forkserver/spawn workers re-run the main script (they do unless
    it is interactive or a package ``__main__``), or None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or _never_rerun(main):
        return None
    frame = _main_module_frame(main.__dict__, path)
    if frame is None or _guarded(path, frame.f_lineno):
        return None
    return (
        f"the loader is made at the top level of {path} (line {frame.f_lineno}), which every "
        f"worker would run again: {_FIX}, or use context='fork'"
    )


def _never_rerun(main: Any) -> bool:
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    return name == "__main__" or name.endswith(".__main__")


def _unreachable_problem(dataset: Any) -> str | None:
    """What ``dataset`` needs from a ``__main__`` that workers do not import, or None."""
    main = sys.modules.get("__main__")
    if dataset is None or (getattr(main, "__file__", None) and not _never_rerun(main)):
        return None
    found = _main_references(dataset)
    if not found:
        return None
    return (
        f"the dataset refers to {', '.join(sorted(found))} defined in __main__ (an "
        "interactive session or a package __main__), which workers cannot import: define it "
        "in a module, or use context='fork'"
    )


def _main_references(obj: Any) -> set[str]:
    """Names of the functions, classes and instances of ``__main__`` that pickling ``obj``
    would refer to."""
    found: set[str] = set()

    class Finder(pickle.Pickler):
        def reducer_override(self, value: Any) -> Any:
            for thing in (value, type(value)):
                if getattr(thing, "__module__", None) == "__main__":
                    found.add(getattr(thing, "__qualname__", repr(thing)))
            return NotImplemented

    try:
        Finder(_Discard()).dump(obj)
    except Exception:  # unpicklable: the DataLoader says so itself when it starts workers
        return found
    return found


class _Discard:
    """A file that keeps nothing: the pickle is only walked, never stored."""

    def write(self, data: bytes) -> int:
        return len(data)


def _main_module_frame(namespace: dict, path: str) -> FrameType | None:
    """The frame running the main script's own top-level code, when it is on the stack."""
    frame = sys._getframe(1)
    target = os.path.realpath(path)
    while frame is not None:
        if (
            frame.f_globals is namespace
            and frame.f_code.co_name == "<module>"
            and os.path.realpath(frame.f_code.co_filename) == target
        ):
            return frame
        frame = frame.f_back
    return None


def _guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script lies in a top-level ``if __name__ == "__main__":``."""
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return False  # unreadable: assume the worst (fork is safe either way)
    return any(
        isinstance(node, ast.If)
        and _is_main_test(node.test)
        and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line)
        for node in tree.body
    )


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    return {ast.unparse(test.left), ast.unparse(test.comparators[0])} == {"__name__", "'__main__'"}
