"""A dataset manifest kept as rows, so the next manifest costs what changed.

Beside ``.zarrfeed/manifests/<name>.json`` the store keeps ``<name>.rows``: one header line
(JSON: the assets, their change-log positions, the keys left out and why, and per-asset
tallies of dtypes, shapes and bytes with their counts), then one line per key in the dataset,
``<key>\\t<entry of asset 1>\\t<entry of asset 2>...`` — each entry the JSON the manifest lists
for that partition.  Replacing a key's row and adjusting the tallies is all a change costs; the
manifest is then written by joining the rows' bytes, without parsing or building an object per
partition (which, at 50,000 partitions of four assets, is where the time of a manifest went).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import orjson
import xxhash

import zarrfeed
from zarrfeed.store import jsonio

ROWS_LAYOUT = 2  # 2: the kept keys agree on every per-dataset setting


class DatasetRows:
    """The keys of a dataset with their manifest entries per asset, and the tallies."""

    def __init__(self, assets: list[str], header: dict[str, Any] | None = None) -> None:
        self.assets = assets
        header = header or {}
        self.rows: dict[str, bytes] = {}
        self.tallies: dict[str, dict[str, Any]] = header.get("tallies") or {
            a: {"arrays": {}, "stored": 0} for a in assets
        }
        self.positions: dict[str, int | None] = header.get("positions") or {}
        self.withheld: dict[str, list[str]] = header.get("withheld") or {}
        self.incomplete: set[str] = set(header.get("incomplete") or ())
        self.failed: dict[str, list[str]] = header.get("failed") or {}

    @classmethod
    def parse(cls, data: bytes, assets: list[str], url: str) -> DatasetRows | None:
        """Rows written by :meth:`dumps` for the same store and assets; None otherwise."""
        head, _, body = data.partition(b"\n")
        try:
            header = jsonio.loads(head)
        except ValueError:
            return None
        if (header.get("layout"), header.get("store"), header.get("assets")) != (
            ROWS_LAYOUT,
            url,
            assets,
        ):
            return None
        rows = cls(assets, header)
        for line in body.split(b"\n"):
            if line:
                rows.rows[line[: line.index(b"\t")].decode()] = line
        return rows

    def dumps(self, url: str) -> bytes:
        header = {
            "layout": ROWS_LAYOUT,
            "store": url,
            "assets": self.assets,
            "positions": self.positions,
            "withheld": self.withheld,
            "incomplete": sorted(self.incomplete),
            "failed": self.failed,
            "tallies": self.tallies,
        }
        lines = [jsonio.dumps(header), *(self.rows[k] for k in sorted(self.rows))]
        return b"\n".join(lines) + b"\n"

    def leave_out(self, key: str) -> None:
        """Forget ``key`` everywhere (its row, its tallies, why it was left out)."""
        row = self.rows.pop(key, None)
        if row is not None:
            for asset, entry in zip(self.assets, row.split(b"\t")[1:], strict=True):
                self._tally(asset, orjson.loads(entry), -1)
        self.incomplete.discard(key)
        self.failed.pop(key, None)

    def add(self, key: str, entries: Sequence[dict[str, Any]]) -> None:
        """``key`` with its manifest entry in each asset (in the order of the assets)."""
        self.rows[key] = b"\t".join([key.encode(), *(jsonio.dumps(e) for e in entries)])
        for asset, entry in zip(self.assets, entries, strict=True):
            self._tally(asset, entry, 1)

    def versions(self, asset: str) -> list[str]:
        """The version of each key's partition of ``asset``, keys sorted."""
        column = self.assets.index(asset) + 1
        rows = (self.rows[k].split(b"\t")[column] for k in sorted(self.rows))
        return [orjson.loads(entry)["version"] for entry in rows]

    def digest(self, tables: dict[str, Any]) -> str:
        """What training would read, as a hex digest: every key's partition versions (and
        what the manifest lists of them), and the facts of the dataset's ``tables``."""
        h = xxhash.xxh3_128(jsonio.dumps([self.assets, tables], default=str))
        for key in sorted(self.rows):
            h.update(self.rows[key] + b"\n")
        return h.hexdigest()

    def _tally(self, asset: str, entry: dict[str, Any], sign: int) -> None:
        tally = self.tallies[asset]
        tally["stored"] += sign * entry["stored_bytes"]
        for name, a in entry["arrays"].items():
            t = tally["arrays"].setdefault(name, {"dtypes": {}, "shapes": {}, "nbytes": 0})
            t["nbytes"] += sign * a["nbytes"]
            for field, value in (("dtypes", a["dtype"]), ("shapes", _shape(a["shape"]))):
                count = t[field].get(value, 0) + sign
                if count:
                    t[field][value] = count
                else:
                    del t[field][value]
            if not t["dtypes"]:
                del tally["arrays"][name]

    def manifest(
        self,
        dataset: str,
        url: str,
        extra: dict[str, Any],
        default: Callable[[Any], Any] | None = None,
    ) -> tuple[bytes, dict[str, Any]]:
        """The dataset manifest: its bytes (``default`` writes what JSON cannot hold in
        ``extra``), and the same as a dict whose partitions are parsed only if looked at."""
        keys = sorted(self.rows)
        columns = list(zip(*(self.rows[k].split(b"\t")[1:] for k in keys), strict=True))
        raw = {
            a: b"[" + b",".join(columns[i] if columns else ()) + b"]"
            for i, a in enumerate(self.assets)
        }
        head = {
            "dataset": dataset,
            "store": url,
            "keys": keys,
            "incomplete": sorted(self.incomplete),
            "failed": {k: self.failed[k] for k in sorted(self.failed)},
            "assets": {a: self._asset(a, url, len(keys)) for a in self.assets},
            "positions": self.positions,
            "withheld": self.withheld,
            **extra,
        }
        for a in self.assets:
            head["assets"][a]["partitions"] = orjson.Fragment(raw[a])
        data = jsonio.dumps(head, default=default)
        for a in self.assets:
            head["assets"][a]["partitions"] = Entries(raw[a])
        return data, head

    def _asset(self, asset: str, url: str, count: int) -> dict[str, Any]:
        """One asset's part of the manifest (its partitions added by :meth:`manifest`)."""
        tally = self.tallies[asset]
        arrays = {
            name: (t["dtypes"], [[int(n) for n in s.split(",")] for s in t["shapes"]], t["nbytes"])
            for name, t in tally["arrays"].items()
        }
        return asset_summary(asset, url, count, tally["stored"], arrays)


def asset_summary(
    asset: str,
    url: str,
    count: int,
    stored: int,
    arrays: dict[str, tuple[Iterable[str], Iterable[list[int]], int]],
) -> dict[str, Any]:
    """One asset's totals in a manifest: ``count`` partitions holding ``stored`` bytes, and
    per array name its dtypes, shapes and decoded bytes (the same fields whether the manifest
    is joined from rows or built from every record)."""
    raw = sum(nbytes for _, _, nbytes in arrays.values())
    return {
        "asset": asset,
        "store": url,
        "zarrfeed_version": zarrfeed.__version__,
        "total_partitions": count,
        "total_stored_bytes": stored,
        "total_nbytes": raw,
        "compression_ratio": raw / stored if stored else None,
        "arrays": {
            name: {"dtypes": sorted(dtypes), "shapes": sorted(shapes), "nbytes": nbytes}
            for name, (dtypes, shapes, nbytes) in sorted(arrays.items())
        },
    }


def _shape(shape: list[int]) -> str:
    return ",".join(str(int(n)) for n in shape)


class Entries(Sequence):
    """A manifest's partitions, parsed on first use (most callers of a freshly written
    manifest only count them or never look)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._items: list[dict[str, Any]] | None = None

    def _list(self) -> list[dict[str, Any]]:
        if self._items is None:
            self._items = jsonio.loads(self.raw)
        return self._items

    def __getitem__(self, i: Any) -> Any:
        return self._list()[i]

    def __len__(self) -> int:
        return len(self._list())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and self._list() == list(other)

    def __repr__(self) -> str:
        return f"Entries({len(self)} partitions)"
