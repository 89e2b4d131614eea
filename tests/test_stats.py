"""StatsTable: named counts per process in shared memory, the dead folded into totals."""

from __future__ import annotations

import contextlib
import mmap
import os

import pytest

from zarrfeed.training.data.stats import StatsTable

COLUMNS = ("hits", "misses")


def _table(rows: int = 4, cells: tuple[str, ...] = ()) -> tuple[StatsTable, mmap.mmap]:
    shared = mmap.mmap(-1, StatsTable.nbytes(COLUMNS, rows, cells))  # shared across fork
    return StatsTable(shared, COLUMNS, rows, contextlib.nullcontext, cells), shared


def _forked(work) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            work()
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_counts_by_name_add_up_over_processes():
    table, _ = _table()
    table.add("hits", 3)
    table.add("misses")
    _forked(lambda: table.add("hits", 5))  # the child's table object counts in its own row
    assert table.totals() == {"hits": 8, "misses": 1}
    with pytest.raises(KeyError):
        table.add("waits")


def test_a_dead_processs_row_is_folded_into_the_totals_and_reused():
    table, shared = _table(rows=2)  # the totals row and one process row
    _forked(lambda: table.add("hits", 5))  # takes the one row, then dies
    table.add("misses", 2)  # reuses it: the child's counts moved to the totals
    assert table.totals() == {"hits": 5, "misses": 2}
    other = StatsTable(shared, COLUMNS, 2, contextlib.nullcontext)
    other.add("hits")  # the same process's second table finds its row
    assert table.totals() == {"hits": 6, "misses": 2}


def test_reset_zeroes_counts_and_cells_are_their_own():
    table, _ = _table(cells=("epoch",))
    table.add("hits", 4)
    table.bump("epoch")
    table.bump("epoch")
    table.reset()
    assert table.totals() == {"hits": 0, "misses": 0} and table.cell("epoch") == 2


def test_a_buffer_of_another_size_is_refused():
    with pytest.raises(ValueError, match="not this table"):
        StatsTable(bytearray(64), COLUMNS, 4, contextlib.nullcontext)
