"""Shared-memory batch slots that DataLoader workers reuse, for the training feed.

A batch goes from a worker to the training process through shared memory.  Made anew for
each batch, that memory costs more than cutting the batch: the kernel allocates and zeroes
every page, then the training process maps them again (measured on a 2-core VM: 16 MB of
fresh shared memory ~16 ms, 32 patches of 64³ cut into it ~2.5 ms; with two workers the
cached loader and ``np.load(mmap)`` both fell to ~800 patches/s from 3,000–6,000 in one
process, so adding workers did not add speed).

With a ring, each worker allocates a few batch slots of shared memory once and writes its
batches into them.  The feed copies each batch out (:func:`settle`: into pinned memory when
it goes to a CUDA device, the copy that pinning makes anyway) and only then frees the slot.
A worker writes a slot only after the feed has freed it, so no batch changes under its
reader.  A worker that finds no free slot for :data:`WAIT_S` (a consumer that stopped
freeing them) falls back to fresh shared memory: slower, never wrong.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

log = logging.getLogger("zarrfeed.training")

RELEASE = "ring_release"  # the batch key of the one-element view that frees its slot
WAIT_S = 10.0  # how long a worker waits for a free slot before it uses fresh memory


class BatchRing:
    """``slots`` batch buffers of ``shape`` and ``dtype`` in shared memory, owned by one
    worker.  A slot is taken by that worker (:meth:`take`) and freed by the process that
    reads it, through the batch's :data:`RELEASE` entry (:func:`settle`)."""

    def __init__(self, slots: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if slots < 1:
            raise ValueError(f"a batch ring needs at least one slot, got {slots}")
        self.shape, self.dtype = tuple(shape), dtype
        self.data = torch.empty((slots, *shape), dtype=dtype).share_memory_()
        self.state = torch.zeros(slots, dtype=torch.int32).share_memory_()  # 1: in use
        self._state = self.state.numpy()
        self._stalled = False  # a wait timed out: no more waiting until a slot comes free

    def fits(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return tuple(shape) == self.shape and dtype == self.dtype

    def take(self, wait_s: float | None = None) -> int | None:
        """A free slot, now marked in use; None when none came free within ``wait_s``
        (default :data:`WAIT_S`), and at once from then on, until one does."""
        wait_s = WAIT_S if wait_s is None else wait_s
        deadline = None
        while True:
            free = np.flatnonzero(self._state == 0)
            if len(free):
                slot = int(free[0])
                self._state[slot] = 1
                self._stalled = False
                return slot
            if self._stalled:
                return None
            now = time.monotonic()
            if deadline is None:
                deadline = now + wait_s
            elif now > deadline:
                self._stalled = True
                log.warning(
                    "no batch slot came free in %.0fs: batches go through fresh shared memory "
                    "(slower) until one does; is the consumer freeing them (ring.settle)?",
                    wait_s,
                )
                return None
            time.sleep(0.0002)

    def batch(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s buffer and the one-element view that frees it."""
        return self.data[slot], self.state[slot : slot + 1]

    def give_back(self, slot: int) -> None:
        """Free a slot this worker took but did not hand on (its read failed)."""
        self._state[slot] = 0


def settle(batch: Any, pin: bool) -> Any:
    """``batch`` safe to keep: a batch in a ring slot is copied out (into pinned memory when
    ``pin``) and its slot freed; any other tensors are pinned when ``pin``."""
    if not isinstance(batch, dict):
        return _pinned(batch) if pin else batch
    release = batch.pop(RELEASE, None)
    if release is None:
        return _pinned(batch) if pin else batch
    out = {k: (v.pin_memory() if pin else v.clone()) if torch.is_tensor(v) else v
           for k, v in batch.items()}  # fmt: skip
    release.fill_(0)  # after the copies: the worker may now write the slot again
    return out


def _pinned(batch: Any) -> Any:
    if torch.is_tensor(batch):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: _pinned(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_pinned(v) for v in batch)
    return batch
