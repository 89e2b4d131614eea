"""Stopping a run on SIGINT or SIGTERM after the step in progress, on every rank alike."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist


class TrainingStopped(Exception):
    """A signal stopped the run; the checkpoint, metrics and plots of ``step`` are written
    (unless it came before the first step).  The message is one line that says so."""

    def __init__(self, message: str, signum: int, step: int) -> None:
        super().__init__(message)
        self.signum, self.step = signum, step


class StopSignals:
    """SIGINT and SIGTERM, while training: ask the loop to stop after the step in progress,
    so that its state is saved.  Before the loop starts, or a second time, they stop at once
    (``TrainingStopped``, or ``KeyboardInterrupt`` for a second Ctrl-C).

    Under DDP, every rank must stop after the same step, though a signal may reach one rank
    only or the ranks at different steps: each step sums the ranks' flags of the step before
    over a CPU (gloo) group without waiting, and all ranks stop when that sum is non-zero.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, world: int) -> None:
        self.world, self.signum, self.armed, self.stopped = world, 0, False, False
        self.outside = "before training began: nothing saved"  # what an unarmed stop means
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers live there only
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.armed and not self.signum:
            self.signum = signum
            return
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the save in progress is abandoned
        raise TrainingStopped(f"stopped by {name} {self.outside}", signum, 0)

    def arm(self) -> None:
        """From here on a signal waits for the end of the step in progress."""
        if self.world > 1 and self._group is None:
            backend = dist.get_backend()
            self._group = dist.new_group(backend="gloo") if backend != "gloo" else None
        self.armed = True

    def disarm(self, outside: str) -> None:
        """From here on a signal stops at once; ``outside`` says what is saved then."""
        self.armed, self.outside = False, outside

    @property
    def name(self) -> str:
        """The signal that stopped the run (under DDP it may have reached another rank)."""
        return signal.Signals(self.signum).name if self.signum else "a signal to another rank"

    def requested(self) -> bool:
        """True once the run should stop (on every rank at the same step under DDP)."""
        if self.world == 1:
            self.stopped = bool(self.signum)
            return self.stopped
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = bool(flag.item())
        flag = torch.tensor([1 if self.signum else 0], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, group=self._group, async_op=True), flag)
        self.stopped = agreed
        return agreed
