"""The training loop: AMP, accumulation, checkpoints and distributed training.

AMP (bf16 or fp16 + GradScaler on CUDA, where AdamW is fused so that the scaler never waits for
the device; bf16 autocast on the CPU on request), gradient accumulation
(``no_sync`` on the micro-batches that do not step), ``zero_grad(set_to_none=True)``, pinned
memory with ``non_blocking`` copies, evaluation under ``inference_mode``, optional gradient
checkpointing and periodic cache release, no global default-tensor tricks.  Checkpoints hold
only tensors and plain values and load with ``weights_only=True``; they carry the step, the
optimiser and scaler state, the RNG state and the sampler position, so a resumed run repeats
the loss curve of an uninterrupted one.  A run continues only a checkpoint of the same run
(``config.run_differences``); another run's checkpoint is left alone and the new run takes
the next free folder.  SIGINT and SIGTERM end the step in progress, then write the
checkpoint, metrics and plots of that step.  Under ``torchrun`` it trains with DDP, one shard
of every epoch per rank, and only rank 0 writes.  A run folder is held by one training at a
time: rank 0 holds its ``train.lock`` for the run's life (another training into the folder
fails at once, naming the holder), and removes the checkpoint files a killed writer left.
The pieces it runs live beside it: :mod:`.runtime` (device, AMP, optimiser),
:mod:`.step` (one optimiser step), :mod:`.checkpoints`, :mod:`.stopping` (signals) and
:mod:`.result`.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from zarrfeed.datasets import snapshots
from zarrfeed.errors import ConfigError
from zarrfeed.processes import Held, Hold, hold
from zarrfeed.store import ZarrStore
from zarrfeed.training.augment import Augment
from zarrfeed.training.checkpoints import (
    RunFolderHeld,
    data_fingerprint,
    read_checkpoint,
    removed_leftovers,
    write_checkpoint,
)
from zarrfeed.training.config import TrainConfig, run_differences
from zarrfeed.training.data.base import StoreDataset
from zarrfeed.training.data.facts import Budgets, world_facts
from zarrfeed.training.data.feed import Feed, make_feed, to_device
from zarrfeed.training.data.protocols import HoldsOut
from zarrfeed.training.report import EventLog, loss_curve_png
from zarrfeed.training.result import TrainResult
from zarrfeed.training.runtime import DistEnv, amp_policy, make_optimizer, resolve_device
from zarrfeed.training.step import Stepper, autocast
from zarrfeed.training.stopping import StopSignals, TrainingStopped
from zarrfeed.training.tasks import PerClass, Task, make_task

LOCK = "train.lock"  # in the run folder: held by the training that writes it
VERSION_BYTES = 64  # a dataset version id, as ranks agree on it

Progress = Callable[[int, int], None]  # (steps done, steps in all), once per step


class Trainer:
    """Runs ``config`` to ``config.train.steps`` optimiser steps, resuming when it can."""

    def __init__(
        self,
        config: TrainConfig,
        log: Callable[[str], None] | None = print,
        task: Task | None = None,
        progress: Progress | None = None,
    ) -> None:
        """``task`` replaces the configured one (a custom dataset or model, a baseline);
        ``progress`` is told the step count once per step (a progress bar)."""
        self.config, self.env = config, DistEnv.from_environ()
        self._log, self._progress = log, progress
        self.task = task or make_task(config)
        self.device = resolve_device(config.train.device, self.env)
        self.amp_dtype, scaled = amp_policy(config.train.amp, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=scaled)
        self._stop = StopSignals(self.env.world)
        self._events: EventLog | None = None
        self._fingerprint: dict[str, Any] = {}
        self._order: dict[str, Any] | None = None  # the epoch order, as checkpoints record it
        self._per_class: PerClass = {}
        self._hold: Hold | None = None  # the run folder's lock (rank 0's)

    def log(self, line: str) -> None:
        if self._log and self.env.main:
            self._log(line)

    @property
    def checkpoint_path(self) -> Path:
        return self.config.run_dir / "last.pt"

    # -- set-up ---------------------------------------------------------------------------

    def _setup_distributed(self) -> bool:
        """Join the ``torchrun`` job; True when this call created the process group."""
        if self.env.world == 1 or dist.is_initialized():
            return False
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        return True

    def _feed(self, dataset: Dataset) -> Feed:
        """The pipelined feed, its producer (and DataLoader workers) started at once."""
        c = self.config
        budgets = Budgets(
            c.train.batch_size,
            workers=c.dataloader.workers,
            preload={"auto": "auto", "always": True, "never": False}[c.dataloader.preload],
            order=c.dataloader.sampler,
            device_cache=c.dataloader.device_cache,
            device_cache_gb=c.dataloader.device_cache_gb,
            context=c.dataloader.context,
        )
        return make_feed(
            dataset,
            self.device,
            budgets,
            world_facts(self.env.rank, self.env.world),
            collate_fn=self.task.collate(dataset),
            seed=c.seed,
            log=self.log,
        )

    def _evaluate(self, model: nn.Module, batches: list[Any]) -> dict[str, float | None]:
        """Mean loss and metrics over fixed batches, and the task's pooled metrics over all of
        them (its per-class tables in ``self._per_class``), without autograd."""
        model.eval()
        totals: dict[str, float] = {}
        with torch.inference_mode(), autocast(self.device, self.amp_dtype):
            for batch in batches:
                loss, metrics = self.task.loss(model, to_device(batch, self.device))
                for k, v in {"loss": loss, **metrics}.items():
                    totals[k] = totals.get(k, 0.0) + float(v) / len(batches)
            pooled, self._per_class = (
                self.task.pooled(model, [to_device(b, self.device) for b in batches])
                if batches
                else ({}, {})  # ranks other than 0 score nothing
            )
        model.train()
        return {k: None if v is None else round(v, 6) for k, v in {**totals, **pooled}.items()}

    def _eval_batches(self, dataset: Dataset) -> list[Any]:
        """Up to ``eval_batches`` batches spread over the task's evaluation samples (its
        ``"eval"`` split: held-out scans for the CT classifier), the same in every run; the
        last batch is short where the split holds fewer samples (the dataset is closed
        after: the batches are all that is kept of it)."""
        collate, b = self.task.collate(dataset), self.config.train.batch_size
        count = min(self.config.data.eval_batches * b, len(dataset))
        picks = np.linspace(0, len(dataset) - 1, count).astype(int)
        if isinstance(dataset, HoldsOut) and self.task.evaluates_on == "held_out":
            held = dataset.eval_keys
            kept = f"{len(held)} of {len(dataset.keys)} scans held out" if held else (
                "nothing held out (one scan): scored on the scan it trains on")  # fmt: skip
            if dataset.split is None:
                kept = "data.holdout none: scored on training samples"
            self.log(f"[{self.config.task}] evaluation: {count} samples; {kept}")
        try:
            return [
                collate([dataset[int(i)] for i in picks[j : j + b]]) for j in range(0, count, b)
            ]
        finally:
            dataset.close()

    # -- checkpoints ----------------------------------------------------------------------

    def _save(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        if not self.env.main:
            return
        payload = {
            **state,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": torch.get_rng_state(),
            "config": self.config.model_dump(),
            "data_fingerprint": self._fingerprint,
            "sample_order": self._order,
        }
        write_checkpoint(self.checkpoint_path, payload)

    def _resume_point(self, dataset: Dataset, feed: Feed) -> dict[str, Any] | None:
        """The checkpoint this run continues, or None to start afresh; either way
        ``self.config.run_name`` then names the folder it writes.

        The configured folder's checkpoint is continued when it is of the same run (or on
        ``resume_anyway``).  Otherwise it is left untouched, the differences are logged, and
        the run continues the first ``<run_name>-N`` folder that holds its own checkpoint or
        starts in the first that holds none.
        """
        c = self.config
        self._fingerprint = data_fingerprint(dataset)
        current = {**c.model_dump(), "data_fingerprint": self._fingerprint}
        note, saved = "", None
        for n in itertools.count(1):
            name = c.run_name if n == 1 else f"{c.run_name or 'run'}-{n}"
            path = Path(c.out) / c.task / name / "last.pt"
            if not path.exists():
                saved = None
                break
            if c.resume:
                saved = read_checkpoint(path)
                differences = self._differences(saved, current) or self._order_differs(saved, feed)
            else:  # never continued: only its folder is skipped
                saved, differences = None, ["resume is off"]
            if n == 1 and differences and c.resume and c.resume_anyway:
                self.log(f"[{c.task}] resuming {path} anyway (resume_anyway), though it "
                         f"differs: {'; '.join(differences)}")  # fmt: skip
                break
            if not differences:
                break
            if n == 1:
                note = (
                    f"{path} is another run ({'; '.join(differences)})"
                    if c.resume
                    else f"resume is off and {path} exists"
                )
        self.config = c.model_copy(update={"run_name": name})
        self._hold_run_dir()
        if note:
            self.log(
                f"[{c.task}] not resuming: {note}; it is left untouched and this run writes "
                f"{self.config.run_dir}"
                + (" (--resume-anyway, or resume_anyway: true, continues it)" if c.resume else "")
            )
        return saved

    def _hold_run_dir(self) -> None:
        """Rank 0 holds the run folder for the run's life, then removes what killed writers
        left there; every rank fails at once, naming the holder, when another training
        holds it (ranks wait for rank 0's answer, so none trains alone)."""
        run, refused = self.config.run_dir, None
        if self.env.main:
            try:
                self._hold = hold(run / LOCK, f"training {self.config.task}")
            except Held as exc:
                refused = exc
            else:
                for leftover in removed_leftovers(run):
                    self.log(f"[{self.config.task}] removed {leftover}: its writer is dead")
        if self.env.world > 1:
            flag = torch.tensor([int(refused is not None)], device=self.device)
            dist.broadcast(flag, src=0)
            if flag.item() and refused is None:
                raise RunFolderHeld(f"{run} is held by another training (rank 0 says who)")
        if refused is not None:
            raise RunFolderHeld(
                f"{run} is held by another training ({refused.who()}; lock {refused.path}): "
                "wait for it to end, or give this one another out or run_name"
            )

    def _order_differs(self, saved: dict[str, Any], feed: Feed) -> list[str]:
        """The feed takes up the epoch order of checkpoint ``saved``'s run (a block shuffle's
        blocks follow the memory of the machine, so a resumed epoch would otherwise repeat
        some samples and skip others); why not, agreed by every rank, which all continue
        the same folder or none."""
        why = feed.follow(saved.get("sample_order"))
        if self.env.world > 1:
            flag = torch.tensor([int(why is not None)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and why is None:
                why = "sample order: another rank cannot take up the checkpoint's"
        return [why] if why else []

    @staticmethod
    def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
        """How ``current`` differs from the run of checkpoint ``saved`` (one written before
        checkpoints held their data's fingerprint is compared by its config alone)."""
        theirs = {
            **saved["config"],
            "data_fingerprint": saved.get("data_fingerprint") or current["data_fingerprint"],
        }
        return run_differences(theirs, current)

    def _load(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset, feed: Feed
    ) -> dict[str, Any] | None:
        saved = self._resume_point(dataset, feed)
        if saved is None:
            return None
        model.load_state_dict(saved["model"])
        fused = [group["fused"] for group in optimizer.param_groups]
        optimizer.load_state_dict(saved["optimizer"])
        for group, kernel in zip(optimizer.param_groups, fused, strict=True):
            group["fused"] = kernel  # the kernel is this machine's choice, not the run's state
        self.scaler.load_state_dict(saved["scaler"])
        torch.set_rng_state(saved["rng"])
        return saved

    # -- the loop -------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        owned = self._setup_distributed()
        try:
            with self._stop:
                return self._fit()
        finally:
            if self._events is not None:
                self._events.close()
            if self._hold is not None:
                self._hold.release()
            if owned:
                dist.destroy_process_group()

    def _fit(self) -> TrainResult:
        c, t = self.config, self.config.train
        torch.manual_seed(c.seed)
        self._pin_dataset_version()
        dataset = self.task.dataset("train")
        self._augment(dataset)
        if len(dataset) < t.batch_size * self.env.world:
            raise ConfigError(
                f"{c.task}: {len(dataset)} samples in {c.store} cannot fill one batch of "
                f"{t.batch_size} per rank on {self.env.world} rank(s); lower train.batch_size"
            )
        # First the feed: its workers start and its device tier fills while the model and
        # the optimiser are built; it produces once it knows where to begin.
        feed = self._feed(dataset)
        try:
            return self._train(dataset, feed)
        finally:
            feed.close()
            dataset.close()

    def _augment(self, dataset: Dataset) -> None:
        """Give the training dataset the configured augmentation (``data.augment``); the
        evaluation batches are never augmented."""
        declared = self.config.data.augment
        if declared is None:
            return
        if not isinstance(dataset, StoreDataset):
            raise ConfigError(
                f"{self.config.task}: data.augment is set, but its training dataset "
                f"{type(dataset).__name__} is no StoreDataset, which applies it"
            )
        dataset.augment = Augment(declared)

    def _pin_dataset_version(self) -> None:
        """Every rank, and the training and evaluation datasets, read one dataset version:
        the configured one, or else the current one when the run starts (rank 0's)."""
        data = self.task.config.data
        if data.dataset_version is not None:
            return
        name = self.task.family.name
        found = bytearray(VERSION_BYTES)
        if self.env.main:
            pointer = snapshots(ZarrStore(self.config.store)).pointer(name) or {}
            found[: len(pointer.get("id") or "")] = (pointer.get("id") or "").encode()
        if self.env.world > 1:
            shared = torch.frombuffer(found, dtype=torch.uint8).to(self.device)
            dist.broadcast(shared, src=0)
            found = bytearray(shared.cpu().numpy().tobytes())
        data.dataset_version = found.rstrip(b"\0").decode() or None

    def _train(self, dataset: Dataset, feed: Feed) -> TrainResult:
        """The training loop.  It never waits for the device between log steps: losses stay
        on the device and are read back, all at once, at log steps and checkpoints.  Each
        step's ``data_time`` is the host's wait for a batch not yet prepared, plus (on CUDA,
        measured by events) the device's wait for its copy or gather; ``step_time`` is the
        rest of the wall time, the synchronisation at the read-back included, so over a log
        window the two add up to the wall-clock time."""
        c, t = self.config, self.config.train
        model = self.task.model(dataset).to(self.device)
        optimizer = make_optimizer(model, t.lr, t.weight_decay, self.device)
        saved = self._load(model, optimizer, dataset, feed)
        self._order = feed.order()  # after the checkpoint's was taken up
        eval_batches = self._eval_batches(self.task.dataset("eval")) if self.env.main else []
        eval_before = saved["eval_before"] if saved else self._evaluate(model, eval_batches)
        state = {
            "step": 0, "epoch": 0, "position": 0, "eval_before": eval_before,
            "per_class_before": saved.get("per_class_before", {}) if saved else self._per_class,
            "history": {"loss": [], "data_time": [], "step_time": [], "samples": []},
        }  # fmt: skip
        if saved:
            state.update({k: saved[k] for k in ("step", "epoch", "position", "history")})
            if state["step"] >= t.steps:
                self.log(
                    f"[{c.task}] {self.checkpoint_path} already finished {state['step']}/"
                    f"{t.steps} steps: nothing to train (raise train.steps to go on, or set "
                    "another out or run_name to start over)"
                )
            else:
                self.log(f"[{c.task}] resumed from {self.checkpoint_path} at step {state['step']}")
        resumed_from = state["step"]

        feed.begin(state["epoch"], state["position"])
        net: nn.Module = model
        if self.env.world > 1:
            net = DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.log(
            f"[{c.task}] device={self.device} amp={self.amp_dtype} "
            f"scaler={self.scaler.is_enabled()} "
            f"world={self.env.world} samples={len(dataset)} batches/epoch={feed.per_epoch} "
            f"accumulate={t.accumulate} steps={t.steps}"
        )
        history, pending = state["history"], []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._stop.arm()
        stepper = Stepper(
            self.task, model, net, optimizer, self.scaler, self.device, self.amp_dtype,
            t.accumulate, t.max_grad_norm, self.env.world,
        )  # fmt: skip
        while state["step"] < t.steps and self._between_steps(state):
            took = stepper.step(feed)
            pending.append(took.loss)
            state["step"] += 1
            epoch, position = took.tag
            state["epoch"], state["position"] = epoch, position + 1  # the batch consumed last
            history["data_time"].append(took.data_time)
            history["step_time"].append(took.compute)
            history["samples"].append(took.samples)
            log_now = state["step"] % t.log_every == 0 or state["step"] == t.steps
            save_now = state["step"] % t.checkpoint_every == 0 or state["step"] == t.steps
            if log_now or save_now:
                self._read_back(pending, history, feed, state["step"])
            if log_now:
                self.log(self._log_line(state["step"], history, t.log_every))
            if t.release_every and state["step"] % t.release_every == 0:
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            if save_now:
                self._save(model, optimizer, state)

        stopped = self._stop.stopped
        if stopped:  # a signal: keep this step, not only the last checkpoint_every one
            if pending:
                self._read_back(pending, history, feed, state["step"])
            self._save(model, optimizer, state)
        else:
            self._stop.disarm(
                f"after step {state['step']}, in the final evaluation: {self.checkpoint_path} "
                "holds every step, metrics.json is not updated"
            )
        # a stopped run is not evaluated: the person waiting wants it to end
        eval_after = self._evaluate(model, eval_batches) if self.env.main and not stopped else {}
        # Steady state, as the log lines report it: the first step waits for worker start-up.
        waited, computed = sum(history["data_time"][1:]), sum(history["step_time"][1:])
        total = waited + computed
        result = TrainResult(
            task=c.task,
            step=state["step"],
            history=history,
            eval_before=eval_before,
            eval_after=eval_after,
            samples_per_s=sum(history["samples"][1:]) * self.env.world / total if total else 0.0,
            data_wait_share=waited / total if total else 0.0,
            checkpoint=str(self.checkpoint_path),
            data=self._fingerprint,
            config=self.config.model_dump(),
            loader=feed.reasons,
            resumed_from=resumed_from,
            per_class=self._per_class if eval_after else {},
            per_class_before=state["per_class_before"],
            stopped_by=self._stop.name if stopped else "",
            peak_memory_mb=(
                torch.cuda.max_memory_allocated(self.device) / 2**20
                if self.device.type == "cuda"
                else 0.0
            ),
        )
        if self.env.main:
            self._write_report(result)
        if stopped:
            run = self.config.run_dir
            raise TrainingStopped(
                f"stopped by {result.stopped_by} at step {result.step}/{t.steps}: checkpoint "
                f"{self.checkpoint_path}, metrics {run / 'metrics.json'}; the same command "
                "continues it",
                self._stop.signum or signal.SIGTERM,
                result.step,
            )
        self.log(f"[{c.task}] eval before {eval_before} -> after {eval_after}")
        return result

    def _read_back(
        self, pending: list[torch.Tensor], history: dict[str, list[float]], feed: Feed, step: int
    ) -> None:
        """Read the pending step losses back in one synchronisation, and move the device's
        waits for data (CUDA events) from the steps' compute time to their data time."""
        t0 = time.perf_counter()
        values = torch.stack(pending).tolist()
        history["step_time"][-1] += time.perf_counter() - t0  # the device work run ahead
        first = step - len(pending) + 1
        pending.clear()
        for i, value in enumerate(values):
            if not math.isfinite(value):
                task = self.config.task
                raise FloatingPointError(f"[{task}] loss is {value} at step {first + i}")
        history["loss"] += values
        waits = feed.device_waits()
        per_step = self.config.train.accumulate
        for i in range(len(waits) // per_step):
            row = len(history["step_time"]) - len(waits) // per_step + i
            moved = min(sum(waits[i * per_step : (i + 1) * per_step]), history["step_time"][row])
            history["data_time"][row] += moved
            history["step_time"][row] -= moved

    def _between_steps(self, state: dict[str, Any]) -> bool:
        """Once per step, before it: the progress hook, the TensorBoard scalars of the steps
        logged so far, and False once a signal asked the run to stop."""
        step = state["step"]
        if self.env.main:
            if self._progress is not None:
                self._progress(step, self.config.train.steps)
            if step % self.config.train.log_every == 0:
                self.events.steps(state["history"])
        return not self._stop.requested()

    @property
    def events(self) -> EventLog:
        """The run's TensorBoard event files, beside ``metrics.json`` (opened on first use,
        once the run folder is chosen)."""
        if self._events is None:
            self._events = EventLog(self.config.run_dir, self.env.world)
        return self._events

    def _log_line(self, step: int, history: dict[str, list[float]], window: int) -> str:
        """The training log line, over the last ``window`` steps: progress, loss, where the
        time went, and the time left at the recent pace."""
        recent = {k: v[-window:] for k, v in history.items()}
        waited, computed = sum(recent["data_time"]), sum(recent["step_time"])
        share = waited / (waited + computed) if waited + computed else 0.0
        rate = sum(recent["samples"]) * self.env.world / (waited + computed or 1)
        total = self.config.train.steps
        eta = (total - step) * (waited + computed) / len(recent["step_time"])
        return (
            f"[{self.config.task}] step {step} | loss={history['loss'][-1]:.4f} | "
            f"data_time={1000 * waited / len(recent['data_time']):.1f}ms | "
            f"step_time={1000 * computed / len(recent['step_time']):.1f}ms | "
            f"samples/s={rate:.1f} | data_wait={100 * share:.1f}% | {step}/{total} steps, "
            f"eta {eta:.0f}s"
        )

    def _write_report(self, result: TrainResult) -> None:
        """metrics.json, loss.png and the last TensorBoard scalars, at the run's last step."""
        run = self.config.run_dir
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.json").write_text(
            json.dumps({**result.summary(), "history": result.history}, indent=1)
        )
        (run / "loss.png").write_bytes(loss_curve_png(result.history["loss"], title=result.task))
        if self._progress is not None:
            self._progress(result.step, self.config.train.steps)
        self.events.steps(result.history)
        self.events.evaluation(0, result.eval_before, result.per_class_before)
        self.events.evaluation(result.step, result.eval_after, result.per_class)
        self.events.flush()


def train(
    config: TrainConfig,
    log: Callable[[str], None] | None = print,
    progress: Progress | None = None,
) -> TrainResult:
    """Train ``config`` (the entry point of ``zarrfeed train`` and the Dagster assets)."""
    return Trainer(config, log, progress=progress).fit()
