"""Keys of the same raw content: which one a dataset keeps, and why the others are withheld.

A renamed raw file (same bytes) gets a new key while the old key's partitions stay
committed; a file copied under a second name gets a second key.  Either way a manifest would
serve the same sample twice (and, across ``train_``/``valid_`` names, leak it between
splits).  The content hash each first-stage partition records (``source_sha256``, in the
record summaries the store keeps incrementally) finds them without reading a commit record
or a raw file; the catalog says which keys still have a source.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import missing_source


def _sourced(item: RawItem | None) -> bool:
    """Whether the key still has a raw source: catalogued, and its file or folder there (a
    root moved or unmounted leaves its old items in the catalog, their locations gone)."""
    return item is not None and missing_source(item) is None


def _current(item: RawItem | None, summary: Mapping[str, Any]) -> bool:
    """Whether the partition was built from the item as it is now (so its recorded hash
    still describes the source)."""
    return item is not None and summary.get("attrs", {}).get("source_stamp") == item.stamp


def duplicates(
    family: str,
    heads: Mapping[str, Mapping[str, Any]],
    index: Mapping[str, RawItem],
    skip: Collection[str] = (),
) -> dict[str, list[str]]:
    """Key → why it is withheld, for every key whose committed first-stage partition
    (``heads``: key → its record summary) has the same source content hash as another's.

    One key of each such group is kept, deterministically: a key with a source before one
    without, one built from its source as it is now before a stale one, then the first in
    sort order.  The others are withheld, naming the kept key:

    * a key whose source is gone (renamed, deleted, its root moved) — its partitions are a
      leftover: the reason gives the ``zarrfeed partitions remove`` command that drops them;
    * a key whose source is still there (one file under two names) — both names are real,
      but one sample must not be served twice: the reason says which file to delete.

    ``index``: the family's catalog; ``skip``: keys already withheld (conflicts), which are
    neither kept nor withheld again.  Only the keys of groups of two or more are stat'ed, so
    50,000 partitions cost one pass over their summaries.
    """
    groups: dict[str, list[str]] = {}
    for key, summary in heads.items():
        sha = summary.get("attrs", {}).get("source_sha256")
        if sha and key not in skip:
            groups.setdefault(sha, []).append(key)
    out: dict[str, list[str]] = {}
    for sha, keys in groups.items():
        if len(keys) < 2:
            continue
        sourced = {k: _sourced(index.get(k)) for k in keys}
        ranked = sorted(
            keys, key=lambda k: (not sourced[k], not _current(index.get(k), heads[k]), k)
        )
        kept, same = ranked[0], f"the same raw content (sha256 {sha[:12]})"
        for key in ranked[1:]:
            remove = f"`zarrfeed partitions remove {family} {key}`"
            if not sourced[key]:
                why = f"its raw source is gone and {kept} holds {same}: remove it with {remove}"
            else:
                here, there = index[key].location, index[kept].location
                why = (
                    f"{here} holds {same} as {kept} ({there}), which the dataset keeps: "
                    f"delete one of the two files, then {remove} if it was this one"
                )
            out[key] = [f"duplicate: {why}"]
    return out
