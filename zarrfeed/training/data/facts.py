"""The facts a loading plan is made from (:func:`~zarrfeed.training.data.plan.plan_loading`),
and their gathering: of the dataset (one sample read to measure it), of this machine, of the
``torchrun`` world, and the budgets a run configures.  Gathering reads; planning decides."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from zarrfeed.processes import available_memory, cpu_budget
from zarrfeed.training.data.base import StoreDataset, collate_batch
from zarrfeed.training.data.device import PoolFacts, pool_facts
from zarrfeed.training.data.protocols import DeviceCuttable, StoreBacked, WorkerConfigurable


# facts ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheFacts:
    """A dataset's decoded-array cache, as planning sees it."""

    in_ram: bool
    nbytes: int  # decoded bytes of every cached array
    budget_bytes: int
    capacity_bytes: int  # what its slots hold (the budget in RAM)
    regime: str

    def order_facts(self) -> tuple[bool, int, int, int]:
        return self.in_ram, self.nbytes, self.budget_bytes, self.capacity_bytes


@dataclass(frozen=True)
class DataFacts:
    """What the plan needs to know of a dataset (:func:`data_facts` reads them)."""

    name: str
    samples: int
    sample_bytes: int = 0  # bytes of one sample's tensors
    cache: CacheFacts | None = None
    # why the device tier cannot cut its batches (None: it can, with ``pool``)
    device_refusal: str | None = "the dataset was not examined for it"
    pool: PoolFacts | None = None
    worker_configurable: bool = False  # it takes WorkerSettings (batch slots, shared reads)
    hands_on: bool = False  # its collate hands a batch read at once on whole (none goes on
    # through an augmentation or a transform, which makes samples that are collated anew)
    augment: str = ""  # its declared augmentation, as the log names it ("": none)


@dataclass(frozen=True)
class Machine:
    """This machine, as planning sees it (:func:`machine_facts`)."""

    cpus: int
    cpus_how: str
    available_memory: int
    cuda: bool  # CUDA is present
    device: str = "cpu"  # the training device
    device_free: int = 0  # free bytes on it (CUDA)
    torch_threads: int = 1  # torch's intra-op threads now
    omp_threads: bool = False  # OMP_NUM_THREADS is set: it wins

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]


@dataclass(frozen=True)
class World:
    """Where this process sits: its rank of ``world``, and the ranks on this machine."""

    rank: int = 0
    world: int = 1
    local: int = 1


@dataclass(frozen=True)
class Budgets:
    """What was configured.  ``device_cache`` is None for a plain DataLoader (no device
    tier, no training feed); ``given_sampler``: the reason of a sampler the caller passed
    ("" when it gives none), None when none was passed."""

    batch_size: int
    workers: int | str = "auto"
    preload: bool | str = "auto"
    order: str = "auto"
    shuffle: bool = True
    given_sampler: str | None = None
    device_cache: str | None = None
    device_cache_gb: float | None = None
    train: bool = True
    pin_memory: bool | None = None  # batches go to CUDA (None: whether CUDA is present)
    ring: bool = False  # the consumer frees batch slots (a plain loader's caller asks)
    context: str = "auto"


# gathering the facts --------------------------------------------------------------------------
def machine_facts(device: torch.device | str = "cpu", device_memory: bool = False) -> Machine:
    """This machine's facts, for a training device ``device`` (``device_memory``: measure
    its free memory too, which starts CUDA in this process)."""
    device = torch.device(device)
    cpus, how = cpu_budget()
    free = torch.cuda.mem_get_info(device)[0] if device_memory and device.type == "cuda" else 0
    return Machine(
        cpus, how, available_memory(), torch.cuda.is_available(), str(device), free,
        torch.get_num_threads(), "OMP_NUM_THREADS" in os.environ,
    )  # fmt: skip


def world_facts(rank: int = 0, world: int = 1) -> World:
    """This process's place: ``rank`` of ``world``, with ``LOCAL_WORLD_SIZE`` ranks here."""
    return World(rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def data_facts(
    dataset: Any, collate_fn: Any = None, device: bool = False, batch_size: int | None = None
) -> DataFacts:
    """What planning needs of ``dataset`` (one sample is read to measure it); ``device``:
    also whether, and with what pool (its augmentation's scratch sized for ``batch_size``),
    the device tier can cut its batches."""
    cache = None
    if isinstance(dataset, StoreBacked):
        c = dataset.cache
        cache = CacheFacts(c.in_ram, c.nbytes, c.budget_bytes, c.capacity_bytes,
                           c.stats()["regime"])  # fmt: skip
    refusal, pool = DataFacts.device_refusal, None
    if device:
        if not (isinstance(dataset, DeviceCuttable) and isinstance(dataset, StoreBacked)):
            refusal = (
                f"{type(dataset).__name__} names no boxes of cached arrays for it to cut "
                "(DeviceCuttable)"
            )
        else:
            refusal = dataset.device_refusal()
            pool = pool_facts(dataset, batch_size) if refusal is None else None
    per_sample = isinstance(dataset, StoreDataset) and dataset.per_sample
    return DataFacts(
        name=type(dataset).__name__,
        samples=len(dataset),
        sample_bytes=sample_bytes(dataset[0]) if len(dataset) else 0,
        cache=cache,
        device_refusal=refusal,
        pool=pool,
        worker_configurable=isinstance(dataset, WorkerConfigurable),
        hands_on=collate_fn is collate_batch and not per_sample,
        augment=dataset.augment.config.describe() if per_sample and dataset.augment else "",
    )


def sample_bytes(sample: Any) -> int:
    """Bytes of the tensors in one sample (a dict, tuple or tensor)."""
    if isinstance(sample, torch.Tensor):
        return sample.nbytes
    if isinstance(sample, dict):
        return sum(sample_bytes(v) for v in sample.values())
    if isinstance(sample, list | tuple):
        return sum(sample_bytes(v) for v in sample)
    return 0
