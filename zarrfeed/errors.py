"""Errors that name what went wrong, where, what was expected and what was found."""

from __future__ import annotations


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
