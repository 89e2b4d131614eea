"""Commit records and their summaries, kept proportional to what changed.

A partition is committed by its record (``.zarrfeed/commits/<asset>/<key>.json``); the
summaries of every record of an asset (what manifests and the nightly evaluation need, a
third of a record's size) are kept in ``.zarrfeed/indexes/<asset>.json`` with the time they
were looked at, and the next caller reads only the records the asset's change log
(:mod:`zarrfeed.store.changes`) names since then.  The records are the truth, so a stale or
lost index or log costs reads, never a wrong answer.
"""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from zarrfeed.errors import StoreError, ZarrfeedError
from zarrfeed.store import commits, jsonio
from zarrfeed.store.bulk import gc_paused
from zarrfeed.store.changes import DELETED, MARGIN_S, ChangeLogError, Intent, now_ns
from zarrfeed.store.contract import CONTENT, UPSTREAM
from zarrfeed.store.keys import check_asset

if TYPE_CHECKING:
    from zarrfeed.store.zarrstore import ZarrStore

# Of .zarrfeed/indexes/<asset>.json: {layout, position, partitions}; 3: summaries hold the
# params (the per-dataset settings' values, datasets.rules.mixed_settings), so older ones
# are read again.
INDEX_LAYOUT = 3
PROVENANCE = ("source", "source_sha256", "code_version", "fingerprint")
SUMMARY_ATTRS = (*PROVENANCE, "source_stamp", UPSTREAM, CONTENT, "params")
_log = logging.getLogger(__name__)


def commit_record(store: ZarrStore, asset: str, key: str) -> dict[str, Any]:
    """:meth:`ZarrStore.commit_record`."""
    path = store.record_path(asset, key)
    try:
        data = store.backend.read(path)
    except FileNotFoundError:
        raise StoreError(f"no committed partition {key!r} of {asset!r} in {store.url}") from None
    return jsonio.named(path, data)


def commit_records(
    store: ZarrStore, asset: str, keys: list[str]
) -> dict[str, dict[str, Any] | None]:
    """:meth:`ZarrStore.commit_records`."""
    paths = [store.record_path(asset, k) for k in keys]
    found = store.backend.read_many(paths)
    return {
        k: None if b is None else jsonio.named(p, b)
        for k, p, b in zip(keys, paths, found, strict=True)
    }


def list_partitions(store: ZarrStore, asset: str) -> list[str]:
    """:meth:`ZarrStore.list_partitions`."""
    names = store.backend.list_dir(store.meta_path("commits", check_asset(asset)))
    return sorted(n[: -len(".json")] for n in names if n.endswith(".json"))


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """What manifests, datasets and the nightly evaluation need of a commit record (a third
    of its size: no codecs, no parameters, no HU decision)."""
    return {
        "key": record["key"],
        "version": record["version"],
        "committed_unix": record.get("committed_unix", 0),
        "arrays": {
            n: {k: a[k] for k in ("shape", "dtype", "chunks", "nbytes")}
            for n, a in record["arrays"].items()
        },
        "stored_bytes": record["stored_bytes"],
        "attrs": {k: record["attrs"][k] for k in SUMMARY_ATTRS if k in record["attrs"]},
        "checks": record.get("checks") or {},
    }


@gc_paused()  # 50,000 summaries, none of them garbage
def summaries(store: ZarrStore, asset: str) -> tuple[dict[str, dict[str, Any]], int | None]:
    """:meth:`ZarrStore.record_summaries`, and where the change log is to be read from next
    (None: the log is unusable), for a caller that follows the log itself."""
    path = store.meta_path("indexes", f"{check_asset(asset)}.json")
    try:
        index: dict[str, Any] = jsonio.loads(store.backend.read(path))
    except (FileNotFoundError, ValueError):
        index = {}
    if index.get("layout") != INDEX_LAYOUT:
        index = {}
    cached: dict[str, Any] = index.get("partitions", {})
    position: int | None = index.get("position")
    looked = now_ns()
    intents = covered(store, asset, position, looked, known=bool(index))
    if intents is not None:
        out, fresh = _apply(store, asset, cached, intents)
    else:
        out, fresh = _scan(store, asset, cached)
        intents = _recent(store, asset, looked)
    after = None if intents is None else next_position(looked, intents, out)
    if fresh or len(out) != len(cached) or after != position:
        state = {"layout": INDEX_LAYOUT, "position": after, "partitions": out}
        with suppress(ZarrfeedError, OSError):  # a cache: the next caller re-reads
            store.backend.write_atomic(path, jsonio.dumps(state, default=commits.json_default))
    return out, after


def covered(
    store: ZarrStore, asset: str, position: int | None, looked: int, known: bool
) -> list[Intent] | None:
    """The intents of ``asset`` from ``position`` on; None when the log does not cover
    them all (logged when ``known``: a reader had looked at it before)."""
    log = store.changes(asset)
    try:
        start = log.start()
        if start is None:
            if known:
                _log.warning("%s has no change log for %s: reading every record's stamp",
                             store.url, asset)  # fmt: skip
            log.begin(looked)  # complete from now on: writers note every commit
            return None
        if position is None or position < start:
            return None
        return log.since(position)
    except ChangeLogError as exc:
        _log.warning("%s: the change log of %s is unusable (%s): reading every record's "
                     "stamp", store.url, asset, exc)  # fmt: skip
        return None


def _recent(store: ZarrStore, asset: str, looked: int) -> list[Intent] | None:
    """The intents of ``asset`` younger than the version grace (commits perhaps still
    landing); None when the log is unusable."""
    log = store.changes(asset)
    try:
        start = log.start()
        return log.since(max(start or looked, looked - int(commits.VERSION_GRACE_S * 1e9)))
    except ChangeLogError:
        return None


def _apply(
    store: ZarrStore, asset: str, cached: dict[str, Any], intents: list[Intent]
) -> tuple[dict[str, Any], int]:
    """``cached`` with the records of the keys ``intents`` name read again."""
    keys = sorted({i.key for i in intents})
    fresh = store.commit_records(asset, keys)
    out = dict(cached)
    for key, record in fresh.items():
        if record is None:
            out.pop(key, None)
        else:
            out[key] = {**summarise(record), "stamp": None}
    return dict(sorted(out.items())), len(fresh)


def _scan(store: ZarrStore, asset: str, cached: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Summaries from one listing of the records with their change stamps, reading
    only those not in ``cached`` with the same stamp."""
    folder = store.meta_path("commits", check_asset(asset))
    listed = {
        name[: -len(".json")]: list(stamp)
        for name, stamp in store.backend.list_stamps(folder).items()
        if name.endswith(".json")
    }
    stale = [k for k, stamp in listed.items() if cached.get(k, {}).get("stamp") != stamp]
    fresh = store.commit_records(asset, stale)
    out = {}
    for key, stamp in sorted(listed.items()):
        if key not in fresh:
            out[key] = cached[key]
        elif fresh[key] is not None:  # else un-committed between the listing and the read
            out[key] = {**summarise(fresh[key]), "stamp": stamp}
    return out, len(stale)


def next_position(looked: int, intents: list[Intent], found: dict[str, Any]) -> int:
    """Where the next look at the change log starts: ``MARGIN_S`` before this one, and no
    later than a key's latest intent younger than the version grace whose record does not
    name it yet (a commit still landing)."""
    grace = int(commits.VERSION_GRACE_S * 1e9)
    after = looked - int(MARGIN_S * 1e9)
    latest = {i.key: i for i in intents}  # an earlier commit landing late notes again
    for i in latest.values():
        version = (found.get(i.key) or {}).get("version")
        landed = version == i.version or (i.version == DELETED and version is None)
        if not landed and looked - i.ns < grace:
            after = min(after, i.ns)
    return after
