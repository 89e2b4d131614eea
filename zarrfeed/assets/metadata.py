"""Metadata a person reads on a materialisation: typed values (numbers the UI plots across
materialisations, paths, timestamps), tables instead of JSON blobs, sizes in MiB, and
labelled preview images (a builder's :class:`~zarrfeed.families.Rows` and
:class:`~zarrfeed.families.Picture` shown as such)."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from zarrfeed.families.facts import Picture, Rows
from zarrfeed.store import ZarrStore
from zarrfeed.store.codecs import codec_text

MIB = 1 << 20


def mib(n: float) -> float:
    return round(n / MIB, 2)


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> dg.MetadataValue:
    """A table the UI shows as one (numbers as numbers, so they sort)."""
    kinds = {int: "int", float: "float", bool: "bool"}
    types = [
        kinds.get(type(rows[0][i]), "string") if rows else "string" for i in range(len(columns))
    ]
    return dg.MetadataValue.table(
        records=[dg.TableRecord(dict(zip(columns, row, strict=True))) for row in rows],
        schema=dg.TableSchema(
            columns=[dg.TableColumn(c, t) for c, t in zip(columns, types, strict=True)]
        ),
    )


def shape_text(shape: Sequence[int]) -> str:
    return "×".join(str(n) for n in shape)


def arrays_table(arrays: Mapping[str, Mapping[str, Any]]) -> dg.MetadataValue:
    """One row per array: shape, dtype, chunks, shards, codec, MiB in memory."""
    return table(
        ["array", "shape", "dtype", "chunks", "shards", "codec", "MiB"],
        [
            [
                name,
                shape_text(a["shape"]),
                a["dtype"],
                shape_text(a["chunks"]),
                shape_text(a["shards"]) if a.get("shards") else "-",
                codec_text(a.get("codec")),
                mib(a["nbytes"]),
            ]
            for name, a in arrays.items()
        ],
    )


def partition_metadata(
    store: ZarrStore, asset: str, key: str, seconds: float | None, why: str
) -> dict[str, Any]:
    """Where a partition is, its arrays, sizes and ratio, and how it came to be: built now
    (``seconds``: time and MiB/s) or reused (``seconds=None``: when it was built); ``why``
    says why it was (re)built or reused."""
    record = store.commit_record(asset, key)
    arrays = record["arrays"]
    nbytes = sum(a["nbytes"] for a in arrays.values())
    stored = record["stored_bytes"]
    timing: dict[str, Any] = (
        {
            "seconds": round(seconds, 2),
            "MiB_per_s": round(nbytes / MIB / max(seconds, 1e-9), 1),
        }
        if seconds is not None
        else {"built_at": dg.MetadataValue.timestamp(record.get("committed_unix", 0.0))}
    )
    return {
        "dagster/uri": dg.MetadataValue.path(store.partition_url(asset, key)),
        "reused": seconds is None,
        "why": why,
        "arrays": arrays_table(arrays),
        "stored_MiB": mib(stored),
        "raw_MiB": mib(nbytes),
        "compression_ratio": round(nbytes / stored, 2) if stored else 0.0,
        **timing,
        "version": record["version"],
    }


def readable(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``metadata`` as the UI shows it best: a builder's tables and pictures as such, empty
    collections as the word "none" (the UI shows an empty dict or list as a "[Show JSON]"
    link that opens ``{}``)."""
    empty = (dict, list, tuple)
    return {k: "none" if isinstance(v, empty) and not v else shown(v) for k, v in metadata.items()}


def shown(value: Any) -> Any:
    if isinstance(value, Rows):
        return table(value.columns, value.rows)
    if isinstance(value, Picture):
        return png_markdown(value.png, value.title, value.caption)
    return value


def png_markdown(png: bytes, title: str, caption: str = "") -> dg.MetadataValue:
    """PNG bytes inline in markdown under a bold ``title``: the UI shows the picture on the
    materialisation (behind "[Show Markdown]": any real image exceeds the inline limit)."""
    data = base64.b64encode(png).decode()
    text = f"**{title}**\n\n![{title}](data:image/png;base64,{data})"
    return dg.MetadataValue.md(text + (f"\n\n{caption}" if caption else ""))
