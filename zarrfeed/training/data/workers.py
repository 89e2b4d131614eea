"""What every DataLoader worker does first: one intra-op thread, Ctrl-C left to its owner,
an end with its owner, and the settings its copy of the dataset is told."""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import torch
from torch.utils.data import get_worker_info

from zarrfeed.processes import process_alive
from zarrfeed.training.data.protocols import WorkerConfigurable, WorkerSettings


def init_worker(owner: int, settings: WorkerSettings, _: int) -> None:
    """``worker_init_fn`` of zarrfeed's loaders (``owner``: the pid that made the loader)."""
    torch.set_num_threads(1)  # workers run side by side; intra-op threads would oversubscribe
    # Ctrl-C in a terminal reaches every process of the foreground group: the owner decides
    # (the trainer finishes its step and saves); a worker that died of it would fail that step
    # with "DataLoader worker exited unexpectedly".  Workers still end with their owner.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(owner,), daemon=True, name="owner-watch").start()
    info = get_worker_info()
    if info is not None and isinstance(info.dataset, WorkerConfigurable):
        info.dataset.configure_worker(settings)  # this worker's copy only


def _exit_with(owner: int) -> None:
    """End this worker when the process that owns its DataLoader ends.

    A forkserver worker is a child of the fork server, not of its owner, and holds the fork
    server open: torch's watchdog (its parent's pid) never fires, so a SIGKILLed or
    OOM-killed trainer would leave its workers, and the shared memory they map, forever.
    """
    try:
        pidfd = os.pidfd_open(owner)  # Linux 5.3+
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is None:  # no pidfds here: poll
        while process_alive(owner):
            time.sleep(1.0)
        os._exit(1)
    select.select([pidfd], [], [])  # readable once the owner has exited
    os._exit(1)
