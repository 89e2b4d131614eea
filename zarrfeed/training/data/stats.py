"""Counters every process on a machine adds to, in a cache's own shared memory.

A table is a buffer of int64 words: a few named cells (an eviction epoch, say), then rows of
an owner pid and one count per named column.  Row 0 holds the totals of processes that are
gone; each live process adds to a row of its own, so that it never needs a lock across
processes to count.  A row whose owner has died is folded into the totals and reused, so
counts outlive their processes and the table never fills with the dead.  Columns are named
once, where the table is made, and read back by name (:meth:`StatsTable.totals`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from zarrfeed.processes import process_alive

WORD = 8


class StatsTable:
    """Counts by ``columns`` per process in ``buffer`` (writable, :meth:`nbytes` long),
    after the ``cells``.  ``locked()`` guards taking a row across processes (the cache's own
    lock, whatever it holds besides).  One table object per process: it remembers its row.
    """

    def __init__(
        self,
        buffer: Any,
        columns: Sequence[str],
        rows: int,
        locked: Callable[[], AbstractContextManager[Any]],
        cells: Sequence[str] = (),
    ) -> None:
        self.columns, self.cells, self.rows = tuple(columns), tuple(cells), int(rows)
        if self.rows < 2:
            raise ValueError(f"a table needs a totals row and a process row, got {rows} rows")
        self._width = 1 + len(self.columns)
        self._column = {name: 1 + i for i, name in enumerate(self.columns)}
        self._cell = {name: i for i, name in enumerate(self.cells)}
        view = memoryview(buffer)
        self._words = (view if view.format == "B" else view.cast("B")).cast("q")
        if len(self._words) != self.nbytes(self.columns, self.rows, self.cells) // WORD:
            raise ValueError(f"a table of {len(self._words) * WORD} bytes is not this table")
        self._locked = locked
        self._lock = threading.Lock()  # threads of one process share its row
        self._pid = os.getpid()
        self._row = -1

    @staticmethod
    def nbytes(columns: Sequence[str], rows: int, cells: Sequence[str] = ()) -> int:
        """Bytes of a table of ``rows`` rows (the totals row among them)."""
        return (len(cells) + rows * (1 + len(columns))) * WORD

    def _at(self, row: int, column: int) -> int:
        return len(self.cells) + row * self._width + column

    def add(self, column: str, n: int = 1) -> None:
        """Add ``n`` to this process's count of ``column``."""
        if not n:
            return
        c = self._column[column]
        with self._lock:
            if self._row < 0 or self._words[self._at(self._row, 0)] != self._pid:
                self._row = self._take_row()
            i = self._at(self._row, c)
            self._words[i] = self._words[i] + n

    def _take_row(self) -> int:
        """This process's row: its own, else a free one or a dead process's (folded into
        the totals first), else the last (shared, folded each time it changes hands)."""
        with self._locked():
            free = None
            for r in range(1, self.rows):
                owner = self._words[self._at(r, 0)]
                if owner == self._pid:
                    return r
                if free is None and not process_alive(owner):
                    free = r
            row = free if free is not None else self.rows - 1
            if self._words[self._at(row, 0)] not in (0, self._pid):
                for c in range(1, self._width):  # a dead process's counts still count
                    self._words[self._at(0, c)] += self._words[self._at(row, c)]
                    self._words[self._at(row, c)] = 0
            self._words[self._at(row, 0)] = self._pid
            return row

    def totals(self) -> dict[str, int]:
        """Every column's count, over every process that ever counted."""
        table = np.frombuffer(
            self._words, np.int64, self.rows * self._width, len(self.cells) * WORD
        )
        sums = table.reshape(self.rows, self._width)[:, 1:].sum(axis=0)
        return {name: int(v) for name, v in zip(self.columns, sums, strict=True)}

    def reset(self) -> None:
        """Zero every count (the owners keep their rows; the cells stay)."""
        for r in range(self.rows):
            for c in range(1, self._width):
                self._words[self._at(r, c)] = 0

    def cell(self, name: str) -> int:
        return self._words[self._cell[name]]

    def bump(self, name: str) -> None:
        """Add one to cell ``name`` (under the cache's lock: cells are not per process)."""
        i = self._cell[name]
        self._words[i] = self._words[i] + 1

    def release(self) -> None:
        """Let go of the buffer (its mapping can then be closed)."""
        self._words.release()
