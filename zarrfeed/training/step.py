"""One optimiser step as the trainer takes it, from its feed: ``accumulate`` micro-batches
forward under autocast and backward through the gradient scaler (``no_sync`` on the ones
that do not step under DDP), then gradient clipping, the scaler's step and update, and
``zero_grad(set_to_none=True)``.  The trainer's loop and the GPU benchmark's limit both
step through :class:`Stepper`, so the limit cannot step differently from the trainer."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zarrfeed.training.data.epochs import Tag
from zarrfeed.training.data.loader import batch_len

if TYPE_CHECKING:
    from zarrfeed.training.tasks import Task


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device``; no context where ``dtype`` is None (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class Batches(Protocol):
    """Where a step takes its batches from: the trainer's :class:`~.data.feed.Feed`, or any
    source of ``(tag, batch)`` pairs already on the training device."""

    def next(self) -> tuple[Tag, Any]: ...


@dataclass
class Stepped:
    """What one step took: the batch consumed last, its loss (on the device, averaged over
    the micro-batches and ranks), its samples, the host's wait for data and the rest."""

    tag: Tag
    loss: torch.Tensor
    samples: int
    data_time: float
    compute: float


@dataclass
class Stepper:
    """The trainer's optimisation step for ``task``'s ``model`` (``net``: the model as it
    trains, e.g. wrapped in DDP), on ``device`` with autocast ``dtype`` (None: fp32)."""

    task: Task
    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device
    dtype: torch.dtype | None
    accumulate: int = 1
    max_grad_norm: float = 0.0
    world: int = 1

    def step(self, feed: Batches) -> Stepped:
        """Take ``accumulate`` batches from ``feed`` and step once.  ``data_time`` is the
        host's wait in ``feed.next``; ``compute`` the rest of the step's wall time."""
        data_time = compute = 0.0
        losses, samples, tag = [], 0, (0, 0)
        ddp = isinstance(self.net, DistributedDataParallel)
        for micro in range(self.accumulate):
            t0 = time.perf_counter()
            tag, batch = feed.next()
            t1 = time.perf_counter()
            sync = micro == self.accumulate - 1 or not ddp
            no_sync = contextlib.nullcontext() if sync else self.net.no_sync()
            with no_sync, autocast(self.device, self.dtype):
                loss, _ = self.task.loss(self.net, batch)
            self.scaler.scale(loss / self.accumulate).backward()
            losses.append(loss.detach())
            samples += batch_len(batch)
            data_time += t1 - t0
            compute += time.perf_counter() - t1
        t2 = time.perf_counter()
        if self.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.stack(losses).float().mean()
        if self.world > 1:
            dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
        compute += time.perf_counter() - t2
        return Stepped(tag, step_loss, samples, data_time, compute)
