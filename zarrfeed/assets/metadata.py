"""Metadata a person wants to see on a materialisation: sizes, speed, a preview image."""

from __future__ import annotations

import base64
import io

import dagster as dg
import numpy as np
from PIL import Image

from zarrfeed.store import ZarrStore


def partition_metadata(store: ZarrStore, asset: str, key: str, seconds: float) -> dict:
    """Shape, dtype, chunks, codec, bytes stored vs raw, ratio, time and MB/s of a partition."""
    record = store.commit_record(asset, key)
    nbytes = sum(a["nbytes"] for a in record["arrays"].values())
    stored = record["stored_bytes"]
    arrays = record["arrays"]
    first = next(iter(arrays.values()))
    return {
        "dagster/uri": dg.MetadataValue.path(store.path(asset, key)),
        "arrays": dg.MetadataValue.json(
            {
                n: {k: a[k] for k in ("shape", "dtype", "chunks", "shards")}
                for n, a in arrays.items()
            }
        ),
        "shape": str(tuple(first["shape"])),
        "dtype": first["dtype"],
        "codec": str(first["codec"]["configuration"] if first["codec"] else None),
        "stored_bytes": stored,
        "raw_bytes": nbytes,
        "compression_ratio": round(nbytes / stored, 3) if stored else 0.0,
        "seconds": round(seconds, 3),
        "MB_per_s": round(nbytes / 1e6 / seconds, 1) if seconds > 0 else 0.0,
    }


def preview(image: np.ndarray, title: str = "preview", max_side: int = 256) -> dg.MetadataValue:
    """A 2-D array in [0, 1] (or uint8) as an inline PNG in markdown."""
    img = np.asarray(image, dtype=np.float32)
    if image.dtype != np.uint8:
        img = np.clip(img, 0, 1) * 255
    pil = Image.fromarray(img.astype(np.uint8))
    pil.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    return png_markdown(buf.getvalue(), title)


def png_markdown(png: bytes, title: str) -> dg.MetadataValue:
    """PNG bytes inline in markdown: the UI shows it on the materialisation."""
    return dg.MetadataValue.md(
        f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})"
    )
