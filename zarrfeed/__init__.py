"""zarrfeed: raw training data → chunked Zarr stores (Dagster) → fast PyTorch loading."""

__version__ = "0.1.0"
