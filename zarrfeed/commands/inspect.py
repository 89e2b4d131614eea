"""``zarrfeed inspect [ASSET [KEY]]`` : what the store holds.

No argument: every stored asset with its partition count, sizes and ratio.  An asset: its
partitions.  An asset and a key: each array's shape, dtype, chunks, codec and sizes, the
partition's provenance and check results, and preview PNGs written to a folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from zarrfeed.commands.options import existing_store, families, reader_options
from zarrfeed.commands.output import human_bytes, print_json, print_table
from zarrfeed.errors import ConfigError
from zarrfeed.formats import previews
from zarrfeed.store import ZarrStore
from zarrfeed.store.codecs import codec_text
from zarrfeed.store.contract import StoredAsset, failed_checks
from zarrfeed.transforms.ct import apply_window

PROVENANCE = ("source", "source_sha256", "code_version", "zarrfeed_version", "params", "geometry")


def stored_assets() -> list[StoredAsset]:
    """Every stored asset of the code location's families."""
    return [spec for c in families() for spec in c.declaration.assets]


def resolve(name: str, specs: list[StoredAsset]) -> StoredAsset:
    """An asset by its Dagster name (``ct_windows``) or store path (``ct/windows``)."""
    for spec in specs:
        if name in (spec.name, spec.path):
            return spec
    known = ", ".join(sorted(s.name for s in specs))
    raise ConfigError(f"no stored asset {name!r}; the stored assets are {known}")


def ratio(raw: int, stored: int) -> float:
    return round(raw / stored, 2) if stored else 0.0


def overview(store: ZarrStore, specs: list[StoredAsset]) -> list[dict[str, Any]]:
    """One row per stored asset."""
    rows = []
    for spec in specs:
        keys = store.list_partitions(spec.path)
        records = [r for r in store.commit_records(spec.path, keys).values() if r]
        stored = sum(r["stored_bytes"] for r in records)
        raw = sum(a["nbytes"] for r in records for a in r["arrays"].values())
        rows.append(
            {
                "asset": spec.name,
                "path": spec.path,
                "partitions": len(records),
                "stored_bytes": stored,
                "raw_bytes": raw,
                "ratio": ratio(raw, stored),
            }
        )
    return rows


def partitions(store: ZarrStore, spec: StoredAsset) -> list[dict[str, Any]]:
    """One row per committed partition of ``spec``."""
    keys = store.list_partitions(spec.path)
    rows = []
    for key, record in store.commit_records(spec.path, keys).items():
        if record is None:
            continue
        first = next(iter(record["arrays"].values()))
        raw = sum(a["nbytes"] for a in record["arrays"].values())
        failed = failed_checks(record)
        rows.append(
            {
                "key": key,
                "committed": record.get("committed_at", ""),
                "arrays": len(record["arrays"]),
                "shape": first["shape"],
                "dtype": first["dtype"],
                "stored_bytes": record["stored_bytes"],
                "ratio": ratio(raw, record["stored_bytes"]),
                "checks": "failed: " + ", ".join(failed) if failed else "ok",
            }
        )
    return rows


def partition(store: ZarrStore, spec: StoredAsset, key: str) -> dict[str, Any]:
    """The arrays, provenance and checks of one partition."""
    if not store.has_partition(spec.path, key):
        known = store.list_partitions(spec.path)
        raise ConfigError(
            f"{spec.name} has no committed partition {key!r}; it has "
            + (", ".join(known[:10]) + (" …" if len(known) > 10 else "") if known else "none")
        )
    record = store.commit_record(spec.path, key)
    attrs = record["attrs"]
    return {
        "asset": spec.name,
        "key": key,
        "url": store.partition_url(spec.path, key),
        "version": record["version"],
        "committed": record.get("committed_at"),
        "arrays": record["arrays"],
        "stored_bytes": record["stored_bytes"],
        "provenance": {k: attrs.get(k) for k in PROVENANCE if k in attrs},
        "checks": record.get("checks") or {},
    }


def write_previews(store: ZarrStore, spec: StoredAsset, key: str, folder: Path) -> list[Path]:
    """Preview PNGs of a partition's image-like arrays: volumes as three orthogonal middle
    slices (HU through the lung window), image stacks as their first image, spike voxels as
    their first sample's bins.  Index arrays (coordinates, origins) have none."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(store.commit_record(spec.path, key)["arrays"])
    volumes: dict[str, np.ndarray] = {}
    written = []
    for name in names:
        dims = spec.array(name).dims
        if dims == ("z", "y", "x"):
            data = store.read_array(spec.path, key, name)
            volumes[name] = (
                apply_window(data, "lung", "float32") if data.dtype == np.int16 else data
            )
        elif dims[-1] == "c" or dims[-3:] == ("bin", "y", "x"):
            first = store.open_array(spec.path, key, name)[0]
            title = f"{spec.name} {key} {name}[0]"
            if first.ndim == 3 and dims[-1] != "c":
                top = max(1, int(first.max()))
                png = previews.grid_png(
                    {"sample 0": [b / top for b in first]},
                    [f"bin {b}" for b in range(len(first))],
                    title,
                )
            else:
                png = previews.image_png(first.squeeze(), title)
            written.append(_write(folder / f"{spec.name}_{key}_{name}.png", png))
    if volumes:
        title = f"{spec.name} {key}: {', '.join(volumes)}"
        png = previews.volume_png(volumes, title)
        written.append(_write(folder / f"{spec.name}_{key}.png", png))
    return written


def _write(path: Path, png: bytes) -> Path:
    path.write_bytes(png)
    return path


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="shapes, dtypes, chunks, sizes, provenance; previews")
    p.add_argument("asset", nargs="?", help="a stored asset (ct_windows or ct/windows)")
    p.add_argument("key", nargs="?", help="one partition of it")
    p.add_argument("--previews", default="previews", help="where preview PNGs are written")
    reader_options(p, main, instance=False)


def main(args: argparse.Namespace) -> int:
    store = existing_store(args.store)
    specs = stored_assets()
    if args.asset is None:
        rows = overview(store, specs)
        if args.json:
            print_json(rows)
            return 0
        print_table(
            ["asset", "path", "partitions", "stored", "in memory", "ratio"],
            [
                [
                    r["asset"],
                    r["path"],
                    r["partitions"],
                    human_bytes(r["stored_bytes"]),
                    human_bytes(r["raw_bytes"]),
                    r["ratio"],
                ]
                for r in rows
            ],
            title=f"store {store.url}",
        )
        return 0
    spec = resolve(args.asset, specs)
    if args.key is None:
        rows = partitions(store, spec)
        if args.json:
            print_json(rows)
            return 0
        print_table(
            ["key", "committed", "arrays", "shape", "dtype", "stored", "ratio", "checks"],
            [
                [
                    r["key"],
                    r["committed"],
                    r["arrays"],
                    "×".join(map(str, r["shape"])),
                    r["dtype"],
                    human_bytes(r["stored_bytes"]),
                    r["ratio"],
                    r["checks"],
                ]
                for r in rows
            ],
            title=f"{spec.name} ({spec.path}) in {store.url}",
        )
        return 0
    info = partition(store, spec, args.key)
    written = write_previews(store, spec, args.key, Path(args.previews))
    info["previews"] = [str(p) for p in written]
    if args.json:
        print_json(info)
        return 0
    arrays = info["arrays"]
    print_table(
        ["array", "shape", "dtype", "chunks", "shards", "codec", "in memory"],
        [
            [
                n,
                "×".join(map(str, a["shape"])),
                a["dtype"],
                "×".join(map(str, a["chunks"])),
                "×".join(map(str, a["shards"])) if a.get("shards") else "-",
                codec_text(a.get("codec")),
                human_bytes(a["nbytes"]),
            ]
            for n, a in arrays.items()
        ],
        title=f"{spec.name} {args.key}: version {info['version']}, committed {info['committed']}",
        notes=[
            f"stored {human_bytes(info['stored_bytes'])} of "
            f"{human_bytes(sum(a['nbytes'] for a in arrays.values()))} in memory; {info['url']}",
            *(f"{k}: {v}" for k, v in info["provenance"].items()),
            "checks: "
            + (
                ", ".join(f"{n} {'ok' if ok else 'FAILED'}" for n, ok in info["checks"].items())
                or "none"
            ),
            *(f"preview: {p}" for p in written),
        ],
    )
    return 0
