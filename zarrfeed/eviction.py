"""Which cache entries make room: the one eviction policy of every cache tier.

Least recently used first, by whatever clock a tier keeps (slot stamps, file times, batch
counts).  Entries may be *protected* (being written, read by the current batch: never chosen)
or carry a *priority* (units the next block reads go after every other: lower first, then
least recently used).  Room is a count of entries, or bytes when the entries' sizes are
given.  On a large set, victims may be chosen among a random sample instead of all, which
keeps choosing cheap while still evicting old entries (an approximate LRU, as Redis's).
"""

from __future__ import annotations

import numpy as np


def victims(
    last_use: np.ndarray,
    need: int,
    sizes: np.ndarray | None = None,
    priority: np.ndarray | None = None,
    protected: np.ndarray | None = None,
    sample: int | None = None,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Positions of the entries to evict, in eviction order: ``need`` entries (or, with
    ``sizes``, the fewest whose sizes add up to ``need`` bytes), fewer where the unprotected
    ones do not suffice.  With ``sample``, only that many entries drawn at random are
    considered when there are more."""
    last_use = np.asarray(last_use)
    candidates = np.arange(len(last_use))
    if sample is not None and len(candidates) > sample:
        rng = rng if rng is not None else np.random.default_rng()
        candidates = np.unique(rng.integers(0, len(last_use), sample))
    if protected is not None:
        candidates = candidates[~np.asarray(protected, bool)[candidates]]
    if need <= 0 or not len(candidates):
        return np.zeros(0, np.int64)
    age = last_use[candidates]
    if priority is not None:
        order = np.lexsort((age, np.asarray(priority)[candidates]))
    elif sizes is None and need < len(candidates):  # only the oldest ``need`` are sorted
        part = np.argpartition(age, need - 1)[:need]
        order = part[np.argsort(age[part], kind="stable")]
    else:
        order = np.argsort(age, kind="stable")
    chosen = candidates[order]
    if sizes is None:
        return chosen[:need]
    freed = np.cumsum(np.asarray(sizes)[chosen])
    return chosen[: int(np.searchsorted(freed, need)) + 1]
