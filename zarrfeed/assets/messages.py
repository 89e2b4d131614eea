"""Pipes messages from a training process, read only as whole lines.

Dagster 1.13's file message readers tail their file with ``readline``, which returns what
the file holds so far: a read that lands while the writer is mid-way through a long message
(one crossing a page, on a busy machine) hands on half a JSON line, the reader thread dies
on it, and the step fails with "did not yield expected outputs" although training finished.
:class:`WholeLineMessageReader` keeps a partial line until its newline arrives.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import dagster as dg
from dagster_pipes import PipesDefaultMessageWriter, PipesParams

POLL_SECONDS = 0.01


class WholeLineMessageReader(dg.PipesMessageReader):
    """Messages the external process writes to a temporary file (the default writer of
    ``open_dagster_pipes``), each handed on once its line is complete."""

    @contextmanager
    def read_messages(self, handler: dg.PipesMessageHandler) -> Iterator[PipesParams]:
        with tempfile.TemporaryDirectory(prefix="zarrfeed-pipes-") as folder:
            path = os.path.join(folder, "messages")
            open(path, "w", encoding="utf-8").close()
            closed = threading.Event()
            thread = threading.Thread(target=self._read, args=(path, handler, closed), daemon=True)
            thread.start()
            try:
                yield {PipesDefaultMessageWriter.FILE_PATH_KEY: path}
            finally:
                closed.set()
                thread.join()

    def _read(self, path: str, handler: dg.PipesMessageHandler, closed: threading.Event) -> None:
        try:
            for line in whole_lines(path, closed.is_set):
                handler.handle_message(json.loads(line))
        except Exception:
            handler.report_pipes_framework_exception(type(self).__name__, sys.exc_info())

    def no_messages_debug_text(self) -> str:
        return "Attempted to read messages from a temporary file."


def whole_lines(path: str, closed: Callable[[], bool]) -> Iterator[str]:
    """Complete lines appended to ``path`` until ``closed()``, then those already written.
    ``closed`` is asked before each read that finds nothing new, so a line written just
    before the close is still read; a last line without its newline (a writer killed
    mid-message) is dropped."""
    pending = ""
    with open(path, encoding="utf-8") as f:
        while True:
            done = closed()
            text = f.readline()
            if text:
                pending += text
                if pending.endswith("\n"):
                    yield pending
                    pending = ""
                continue
            if done:
                return
            time.sleep(POLL_SECONDS)
