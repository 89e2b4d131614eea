"""UTC time stamps in names (object stores give folders no mtime): ``20261123T180102123Z``,
sortable as text, to the millisecond."""

from __future__ import annotations

import calendar
import re
import time

PATTERN = r"\d{8}T\d{9}Z"  # a stamp, for names that embed one


def stamp(now: float | None = None) -> str:
    now = time.time() if now is None else now
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now * 1000) % 1000:03d}Z"


def stamp_time(text: str) -> float:
    """The time of a stamp matched by :data:`PATTERN`."""
    return calendar.timegm(time.strptime(text[:15], "%Y%m%dT%H%M%S")) + int(text[15:18]) / 1000


def match(pattern: re.Pattern[str], name: str) -> float | None:
    """The time of the stamp in ``name`` (``pattern``'s first group), if it fully matches."""
    m = pattern.fullmatch(name)
    return stamp_time(m.group(1)) if m else None
