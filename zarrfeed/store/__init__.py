"""The Zarr data contract: layout, codecs, atomic partition commits, keys; storage only
(datasets over it are :mod:`zarrfeed.datasets`)."""

from zarrfeed.store.backends import Backend, LocalBackend, ObjectBackend, open_backend
from zarrfeed.store.chunkio import ChunkedArray
from zarrfeed.store.codecs import chunks_for, compressors_for
from zarrfeed.store.commits import PartitionWriter
from zarrfeed.store.keys import check_asset, check_key, sanitise_key
from zarrfeed.store.provenance import file_sha256, provenance
from zarrfeed.store.zarrstore import ZarrStore

__all__ = [
    "Backend",
    "ChunkedArray",
    "LocalBackend",
    "ObjectBackend",
    "PartitionWriter",
    "ZarrStore",
    "check_asset",
    "check_key",
    "chunks_for",
    "compressors_for",
    "file_sha256",
    "open_backend",
    "provenance",
    "sanitise_key",
]
