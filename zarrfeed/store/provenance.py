"""Where a partition came from: source, source hash, code version and parameters."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import zarrfeed


def file_sha256(path: str | Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def provenance(
    source: str,
    source_sha256: str | None,
    code_version: str,
    params: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The attributes every committed partition carries (JSON-safe)."""
    return {
        "source": source,
        "source_sha256": source_sha256,
        "code_version": code_version,
        "zarrfeed_version": zarrfeed.__version__,
        "params": params or {},
        **extra,
    }
