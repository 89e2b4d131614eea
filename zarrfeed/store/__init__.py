"""The Zarr data contract: layout, codecs, atomic partition commits, manifests, keys."""

from zarrfeed.store.chunkio import read_array, read_into, write_from
from zarrfeed.store.codecs import chunks_for, compressors_for
from zarrfeed.store.keys import check_asset, check_key, sanitise_key
from zarrfeed.store.provenance import file_sha256, provenance
from zarrfeed.store.zarrstore import PartitionWriter, ZarrStore

__all__ = [
    "PartitionWriter",
    "ZarrStore",
    "check_asset",
    "check_key",
    "chunks_for",
    "compressors_for",
    "file_sha256",
    "provenance",
    "read_array",
    "read_into",
    "sanitise_key",
    "write_from",
]
