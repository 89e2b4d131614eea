"""Errors that name what went wrong, where, what was expected and what was found."""

from __future__ import annotations

import re
from typing import Any


class ZarrfeedError(Exception):
    """Base class of every error zarrfeed raises on purpose."""


class InputError(ZarrfeedError, ValueError):
    """A raw input file does not hold what its reader expects."""

    def __init__(self, path: object, expected: str, found: str) -> None:
        self.path, self.expected, self.found = str(path), expected, found
        super().__init__(f"{self.path}: expected {expected}, found {found}")


class InvalidKeyError(ZarrfeedError, ValueError):
    """A partition or asset key that is unsafe or not canonical."""


class StoreError(ZarrfeedError):
    """The store does not hold what was asked for."""


class ConfigError(ZarrfeedError, ValueError):
    """A configuration that cannot run: the message names the file or field and why."""


def _subclass_names(cls: type) -> set[str]:
    return {cls.__name__, *(n for sub in cls.__subclasses__() for n in _subclass_names(sub))}


def root_cause(error: Any) -> str:
    """What failed, in one line, from a Dagster error (a ``SerializableErrorInfo``): the
    outermost zarrfeed error of its cause chain — the message that names the file or the
    server, not its own cause (a bare gzip or socket error) nor Dagster's "Error occurred
    while executing op" — else the innermost cause."""
    chain = []
    while error is not None:
        chain.append(error)
        error = getattr(error, "cause", None)
    ours = _subclass_names(ZarrfeedError)
    error = next((e for e in chain if e.cls_name in ours), chain[-1])
    message = (error.message or "").strip()
    # "zarrfeed.errors.InputError: path: expected …" → "path: expected …"
    message = re.sub(rf"^[\w.]*{re.escape(error.cls_name)}: ", "", message)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "1 blocking asset check failed …:"
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else error.cls_name
