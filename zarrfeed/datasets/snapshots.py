"""Dataset versions: every dataset manifest is an immutable snapshot with a stable id.

A training run lasts days while the nightly rebuilds change the store under it, and a model
is only reproducible if the data it read can be read again.  So a manifest is never
overwritten: each build that changes what training would read writes a new one, named by
its id, and then moves the dataset's small pointer to it::

    .zarrfeed/snapshots/<name>/<id>.json   the manifest: keys, partition versions, table versions
    .zarrfeed/manifests/<name>.json        the pointer: current id, retention, recent history

An id is ``<UTC time>-<content digest>`` (``20261201T223815123Z-3fa2b1c45d6e7f80``): sortable
by age, and the same digest means the same data, so a build that changes nothing keeps the
current id (and the Dagster data version, which is the id); a build that changes only the
snapshot's report of what it left out and why rewrites that snapshot, its data unchanged.
The versions a retained snapshot names are never collected
(:func:`zarrfeed.datasets.collect`): the last ``Retention.last`` snapshots
and all younger than ``Retention.days``, as Delta Lake's ``VACUUM`` keeps seven days by
default; a reader holding a lease (:mod:`zarrfeed.datasets.leases`) keeps its snapshot beyond
that.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from zarrfeed.errors import StoreError
from zarrfeed.store import jsonio
from zarrfeed.store.backends import Backend
from zarrfeed.store.keys import check_asset
from zarrfeed.store.layout import manifest_path, meta, snapshot_path
from zarrfeed.store.stamps import PATTERN, match, stamp

ID = re.compile(rf"({PATTERN})-([0-9a-f]{{16}})")
HISTORY_KEPT = 64  # superseded ids the pointer remembers, with when they were superseded


@dataclass(frozen=True)
class Retention:
    """How long a dataset's superseded versions stay readable: the last ``last`` of them
    and every one younger than ``days`` (the current one always)."""

    last: int = 10
    days: float = 7.0

    def __post_init__(self) -> None:
        if self.last < 1 or self.days < 0:
            raise ValueError(f"retention keeps at least the last version: {self}")

    def describe(self) -> str:
        return f"the last {self.last} versions and all younger than {self.days:g} days"


def _seal(data: bytes) -> str:
    """The digest of a snapshot's bytes, kept in the pointer: a build whose data is unchanged
    rewrites the snapshot only when its report (``incomplete``, ``failed``) changed."""
    return xxhash.xxh3_128_hexdigest(data)


def new_id(digest: str, now: float | None = None) -> str:
    return f"{stamp(now)}-{digest[:16]}"


def id_time(snapshot: str) -> float | None:
    """When snapshot ``snapshot`` was written; None for a name that is no id."""
    return match(ID, snapshot)


def id_digest(snapshot: str) -> str | None:
    m = ID.fullmatch(snapshot)
    return m.group(2) if m else None


def is_id(value: str | None) -> bool:
    return bool(value) and ID.fullmatch(value or "") is not None


class Snapshots:
    """The dataset versions of one store."""

    def __init__(self, backend: Backend, url: str) -> None:
        self.backend, self.url = backend, url

    def _path(self, *parts: str) -> str:
        return self.backend.join(*parts)

    def pointer(self, name: str) -> dict[str, Any] | None:
        """Dataset ``name``'s pointer (None: never published)."""
        path = self._path(manifest_path(check_asset(name)))
        try:
            found = jsonio.named(path, self.backend.read(path))
        except FileNotFoundError:
            return None
        return found

    def ids(self, name: str) -> list[str]:
        """Ids of every stored version of ``name``, oldest first."""
        names = self.backend.list_dir(self._path(snapshot_path(check_asset(name))))
        return sorted(n[: -len(".json")] for n in names if is_id(n[: -len(".json")]))

    def datasets(self) -> list[str]:
        """Every dataset with a pointer or stored versions."""
        pointers = {
            n[: -len(".json")]
            for n in self.backend.list_dir(self._path(meta("manifests")))
            if n.endswith(".json")
        }
        return sorted(pointers | set(self.backend.list_dir(self._path(meta("snapshots")))))

    def read(self, name: str, snapshot: str | None = None) -> dict[str, Any]:
        """The manifest of version ``snapshot`` of ``name`` (default: the current one)."""
        pointer = self.pointer(name)
        if pointer is None:
            raise StoreError(f"no manifest for {name!r} in {self.url}; build it first")
        wanted = snapshot or pointer["id"]
        path = self._path(snapshot_path(name, wanted))
        try:
            data = self.backend.read(path)
        except FileNotFoundError:
            retention = Retention(**pointer.get("retention", {}))
            kept = self.ids(name)
            raise StoreError(
                f"dataset {name!r} of {self.url} has no version {wanted}: "
                + (
                    "not an id of this dataset"
                    if not is_id(wanted)
                    else f"it is past retention ({retention.describe()}) and was collected"
                )
                + f"; retained: {', '.join(kept[-5:]) or 'none'} (`zarrfeed datasets list`)"
            ) from None
        return jsonio.named(path, data)

    def publish(
        self,
        name: str,
        digest: str,
        tables: dict[str, str],
        retention: Retention,
        write: Callable[[dict[str, Any]], bytes],
    ) -> dict[str, Any]:
        """Make the manifest ``write(head)`` returns the bytes of (with the versions of its
        ``tables``) version ``digest`` of ``name``: unchanged content keeps the current id;
        otherwise the snapshot is written first and the pointer moved last, so a reader of
        the pointer always finds it whole.  Returns the ``head`` the manifest gained:
        ``id``, ``created_unix``, ``tables``."""
        pointer = self.pointer(name) or {}
        now = time.time()
        current = pointer.get("id")
        if current and id_digest(current) == digest[:16]:
            head = {"id": current, "created_unix": pointer["created_unix"],
                    "tables": pointer.get("tables", {})}  # fmt: skip
            data = write(head)
            update = {"retention": asdict(retention), "sealed": _seal(data)}
            if any(pointer.get(k) != v for k, v in update.items()):
                if pointer.get("sealed") != update["sealed"]:
                    # The same data with another report (what was left out, and why): a
                    # reader meets the old bytes or the new, both listing the same data.
                    self.backend.write_atomic(self._path(snapshot_path(name, current)), data)
                self._point(name, {**pointer, **update})
            return head
        head = {"id": new_id(digest, now), "created_unix": now, "tables": tables}
        data = write(head)
        self.backend.write_atomic(self._path(snapshot_path(name, head["id"])), data)
        history = pointer.get("history", [])
        if current:
            history = [[current, now], *history][:HISTORY_KEPT]
        self._point(name, {"dataset": name, **head, "retention": asdict(retention),
                           "sealed": _seal(data), "history": history})  # fmt: skip
        return head

    def _point(self, name: str, pointer: dict[str, Any]) -> None:
        self.backend.write_atomic(self._path(manifest_path(name)), jsonio.dumps(pointer))

    def retained(
        self, name: str, now: float, leased: set[str], window_s: float
    ) -> tuple[dict[str, str], list[str]]:
        """(id → why it is kept, ids to collect) of dataset ``name``: the current version,
        the retention's, those a live reader leases, and those superseded or written within
        ``window_s`` (a reader between reading the pointer and writing its lease, a build
        between writing its snapshot and moving the pointer)."""
        ids = self.ids(name)
        pointer = self.pointer(name) or {}
        retention = Retention(**pointer.get("retention", {}))
        superseded = {i: t for i, t in pointer.get("history", [])}
        why: dict[str, str] = {}
        for i in ids:
            born = id_time(i) or now
            if i == pointer.get("id"):
                why[i] = "current"
            elif i in leased:
                why[i] = "read by a live reader"
            elif now - superseded.get(i, born) < window_s or now - born < window_s:
                why[i] = "just superseded"
            elif now - born < retention.days * 86400:
                why[i] = f"younger than {retention.days:g} days"
        for i in ids[-retention.last :]:
            why.setdefault(i, f"one of the last {retention.last}")
        return why, [i for i in ids if i not in why]

    def remove(self, name: str, snapshot: str) -> None:
        self.backend.remove(self._path(snapshot_path(name, snapshot)))
