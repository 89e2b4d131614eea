"""Codec and chunk choices, taken from ``benchmarks/codecs.py`` on zarrfeed's own data.

Training decodes each chunk many times for each time it is written, so decode speed wins
over the last 20 % of compression (1 thread, 64³ chunks of a noisy phantom; zarr's default is
zstd level 0):

* int16 HU, float16 windows, uint16 coordinates: Blosc-LZ4 + byte shuffle — ratio 3.6 vs 4.3,
  decode 4.0 vs 1.2 GB/s;
* uint8 windows: Blosc-LZ4, no shuffle — ratio 2.3 vs 4.1, decode 4.0 vs 0.6 GB/s (bit shuffle
  packs to 2.8 but decodes at 1.0 GB/s);
* spike streams and spike-count bins: Blosc-LZ4 + bit shuffle — ratio 7.7 vs 5.3, and still
  faster to decode than zstd (0.75 vs 0.5 GB/s).

Chunks follow how training reads: 64³ blocks for patch reads of volumes (0.5 MiB of float16,
large enough to amortise zarr-python's ~0.5 ms per chunk), whole frames for 2-D data, one
sample per chunk for (sample, …) stacks read a few samples at a time, long row blocks for
(N, k) tables.  Chunks under 128 KiB are grouped into shards so a
partition stays a handful of files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from zarr.codecs import BloscCodec

Read = Literal["patch", "frame", "sample", "rows", "whole"]
Content = Literal["dense", "events"]

PATCH_EDGE = 64
MIN_UNSHARDED_CHUNK = 128 * 1024
TARGET_SHARD = 16 * 1024 * 1024
ROWS_CHUNK = 1 << 16


def compressors_for(dtype: np.dtype | str, content: Content = "dense") -> list[BloscCodec]:
    from zarr.codecs import BloscCodec  # zarr loads with the first array written

    dtype = np.dtype(dtype)
    if content == "events":
        return [BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle", typesize=dtype.itemsize)]
    if dtype.itemsize == 1:
        return [BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle", typesize=1)]
    return [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=dtype.itemsize)]


def chunks_for(
    shape: tuple[int, ...],
    dtype: np.dtype | str,
    read: Read = "patch",
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(chunks, shards or None) for an array of ``shape`` read the ``read`` way."""
    itemsize = np.dtype(dtype).itemsize
    shape = tuple(max(1, int(n)) for n in shape)
    if read == "patch":
        chunks = tuple(min(PATCH_EDGE, n) for n in shape[-3:])
        chunks = (1,) * (len(shape) - len(chunks)) + chunks
    elif read == "frame":
        chunks = (1,) * (len(shape) - 2) + shape[-2:]
    elif read == "sample":  # one item of the leading axis per chunk (a frame with its channels)
        chunks = (1, *shape[1:])
    elif read == "rows":
        chunks = (min(ROWS_CHUNK, shape[0]), *shape[1:])
    elif read == "whole":
        chunks = shape
    else:
        raise ValueError(f"unknown read pattern {read!r}")
    chunk_bytes = int(np.prod(chunks)) * itemsize
    n_chunks = int(np.prod([-(-n // c) for n, c in zip(shape, chunks, strict=True)]))
    if chunk_bytes >= MIN_UNSHARDED_CHUNK or n_chunks <= 4:
        return chunks, None
    # Group chunks along the leading axes until a shard reaches TARGET_SHARD.
    shards = list(chunks)
    for axis in range(len(shape)):
        room = TARGET_SHARD // (int(np.prod(shards)) * itemsize)
        grow = max(1, min(room, -(-shape[axis] // chunks[axis])))
        shards[axis] = chunks[axis] * grow
        if grow < -(-shape[axis] // chunks[axis]):
            break
    return chunks, tuple(shards)


def codec_text(codec: Mapping[str, Any] | None) -> str:
    """``{"name": "blosc", "configuration": {"cname": "zstd", "clevel": 3, ...}}`` →
    ``blosc zstd level 3, bitshuffle``."""
    if not codec:
        return "none"
    conf = codec.get("configuration") or {}
    words = [codec.get("name", "?")]
    if "cname" in conf:
        words.append(str(conf["cname"]))
    if "clevel" in conf or "level" in conf:
        words.append(f"level {conf.get('clevel', conf.get('level'))}")
    text = " ".join(words)
    shuffle = conf.get("shuffle")
    return f"{text}, {shuffle}" if shuffle and shuffle != "noshuffle" else text
