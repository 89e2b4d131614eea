"""Checkpoints and run folders: what a checkpoint records of the data, reading one safely,
writing one atomically, and the leftovers a killed writer leaves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from zarrfeed.errors import ConfigError, ZarrfeedError
from zarrfeed.processes import process_alive


def data_fingerprint(dataset: Dataset) -> dict[str, Any]:
    """What the model trained on: the dataset version it read (its id names the partitions'
    exact versions, readable again while retained) and its partitions."""
    return {
        "dataset": dataset.dataset,
        "dataset_version": dataset.dataset_version,
        "partitions": len(dataset.keys),
    }


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint, loaded with ``weights_only=True`` (tensors and plain values only); one
    that cannot be read (cut short by a copy, or not a zarrfeed checkpoint) fails naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"{path}: not a readable checkpoint ({reason}); it is left untouched: restore it "
            "to continue its run, or move it away (or set another run_name or out) to start "
            "afresh"
        ) from exc


class RunFolderHeld(ZarrfeedError):
    """Another training holds the run folder this one would write."""


def removed_leftovers(run: Path) -> list[Path]:
    """Remove the checkpoint files ``last.<pid>.tmp`` in ``run`` whose writer, a process of
    this machine, is dead (a ``kill -9`` during a checkpoint write leaves one); those of live
    writers are kept.  What was removed."""
    removed = []
    for tmp in run.glob("last.*.tmp"):
        pid = tmp.name.split(".")[1]
        if pid.isdigit() and not process_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def write_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` through ``last.<pid>.tmp`` and a rename, so that a crash
    never leaves half a checkpoint under the real name (:func:`removed_leftovers` reads the
    pid of a writer that died)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
