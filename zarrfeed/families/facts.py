"""Facts a builder reports about a partition beyond numbers and text: a table and a picture.

Builders stay free of Dagster; the Dagster layer shows a :class:`Rows` as a table and a
:class:`Picture` as an inline image on the materialisation (``zarrfeed.assets.metadata``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rows:
    """A small table: numbers stay numbers, so the UI sorts them."""

    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]


@dataclass(frozen=True)
class Picture:
    """PNG bytes under a title."""

    png: bytes
    title: str
    caption: str = ""
