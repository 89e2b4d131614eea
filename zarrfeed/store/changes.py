"""A per-asset log of commit intents: which partitions may have changed since a given time.

Every commit (and every un-commit) of a partition first writes one empty object whose name is
the entry, then its commit record::

    .zarrfeed/changes/<asset>/start.json                          {"since_ns": ...}
    .zarrfeed/changes/<asset>/<YYYYMMDDHH>/<ns>.<version>.<key>   an intent

The log only says *which keys to look at*: the commit record stays the one truth, so an
intent whose commit crashed reads as the record it left (the old version, or none) and is
never taken for a commit.  A reader that remembers its position (a time) lists the hour
folders from there on and re-reads only the records those intents name.

What makes that safe:

- ``start.json`` says from when the log is complete; a position before it (the log was
  compacted, lost, or began after the reader's last look) means a full scan.
- An intent is visible within ``MARGIN_S / 2`` of the time in its name, or its writer writes it
  again before committing (:meth:`ChangeLog.note`), and a record written later than that
  after its intent is noted again after it; a reader's next position is ``MARGIN_S`` before
  its listing and never after a key's latest intent still *pending* (its record does not
  name its version yet), so a slow commit is read once it lands.
- Clocks of the machines writing one store agree within ``MARGIN_S / 2``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from zarrfeed.store import jsonio
from zarrfeed.store.backends import TEMPORARY, Backend
from zarrfeed.store.layout import META

MARGIN_S = 600.0  # how far before its listing a reader's next look starts
DELETED = "deleted"  # the version an un-commit's intent names
_START = "start.json"


class ChangeLogError(ValueError):
    """The log cannot be trusted (its start marker or an entry is unreadable)."""


@dataclass(frozen=True)
class Intent:
    """One entry: ``key`` was about to be committed at ``version`` (or un-committed) at
    ``ns`` nanoseconds since the epoch."""

    ns: int
    version: str
    key: str


def now_ns() -> int:
    return time.time_ns()


def _hour(ns: int) -> str:
    return time.strftime("%Y%m%d%H", time.gmtime(ns / 1e9))


class ChangeLog:
    """The change log of one asset in one store."""

    def __init__(self, backend: Backend, asset: str) -> None:
        self.backend = backend
        self.folder = backend.join(META, "changes", asset)
        self._started = False

    def note(self, key: str, version: str) -> int:
        """Record that ``key`` is about to be committed at ``version`` (:data:`DELETED`:
        un-committed), before the commit record is written; returns the intent's time.  A
        record written later than ``MARGIN_S / 2`` after that is noted again after it."""
        if not self._started:
            if not self.backend.exists(f"{self.folder}/{_START}"):
                self.begin(now_ns())
            self._started = True
        while True:
            ns = now_ns()
            self.backend.write_atomic(f"{self.folder}/{_hour(ns)}/{ns:020d}.{version}.{key}", b"")
            if now_ns() - ns < MARGIN_S / 2 * 1e9:
                return ns  # visible soon enough after its name's time; else name it again

    def begin(self, since_ns: int) -> None:
        """Declare the log complete from ``since_ns`` on."""
        self.backend.write_atomic(f"{self.folder}/{_START}", jsonio.dumps({"since_ns": since_ns}))

    def start(self) -> int | None:
        """From when the log is complete; None when it has no start marker."""
        try:
            return int(jsonio.loads(self.backend.read(f"{self.folder}/{_START}"))["since_ns"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            raise ChangeLogError(f"{self.folder}/{_START} is unreadable ({exc})") from None

    def since(self, ns: int) -> list[Intent]:
        """Intents at or after ``ns``, oldest first."""
        hour = _hour(ns)
        found = []
        for folder in sorted(self.backend.list_dir(self.folder)):
            if folder == _START or folder < hour:
                continue
            if not (len(folder) == 10 and folder.isdigit()):
                raise ChangeLogError(f"{self.folder}/{folder} is not an hour of the log")
            for name in self.backend.list_dir(f"{self.folder}/{folder}"):
                if name.endswith(TEMPORARY):  # a local writer died mid-write: no commit followed
                    continue
                intent = _parse(name)
                if intent is None:
                    raise ChangeLogError(f"{self.folder}/{folder}/{name} is not an intent")
                if intent.ns >= ns:
                    found.append(intent)
        return sorted(found, key=lambda i: i.ns)

    def compact(self, before_ns: int) -> int:
        """Remove the hours wholly before ``before_ns`` (the start moves first, so a reader
        whose position was in them scans in full); returns how many hours went."""
        hour = _hour(before_ns)
        old = [f for f in self.backend.list_dir(self.folder) if f != _START and f < hour]
        if not old:
            return 0
        start = self.start() or 0
        self.begin(max(start, before_ns))
        for folder in old:
            self.backend.remove_tree(f"{self.folder}/{folder}")
        return len(old)


def _parse(name: str) -> Intent | None:
    ns, _, rest = name.partition(".")
    version, _, key = rest.partition(".")
    if not (ns.isdigit() and version and key):
        return None
    return Intent(int(ns), version, key)
