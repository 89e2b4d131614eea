"""CT patch batches cut on the training device from volumes uploaded to it once.

Measured on an H200 with the CT classifier (``benchmarks/train.py``): at 32 patches of 64³
per step the cached DataLoader delivers ~2,100 patches/s whatever its worker count, and the
GPU waits for data 44–57 % of each step — the host copies every patch three times (crop,
shared-memory hand-off, pinned buffer) before the transfer.  A dataset that fits the GPU's
memory needs none of that: its volumes go to the device once and a batch is a handful of
slicing views stacked by one kernel.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from zarrfeed.training.data.ct import CTPatchDataset
from zarrfeed.training.data.loader import LoaderPlan

# Share of the device's free memory a dataset may take to be held there ("auto").
DEVICE_SHARE = 0.25


class DevicePatches:
    """A :class:`CTPatchDataset` (patch mode) with its volumes and labels on ``device``."""

    def __init__(self, dataset: CTPatchDataset, device: torch.device) -> None:
        if not dataset.patch:
            raise ValueError("DevicePatches cuts patches: build the dataset with patch=True")
        self.dataset, self.device = dataset, device
        with warnings.catch_warnings():  # cache entries are read-only; .to() copies them
            warnings.simplefilter("ignore", UserWarning)
            self.volumes = [
                torch.from_numpy(dataset.array(i, dataset.window)).to(device, copy=True)
                for i in range(len(dataset.keys))
            ]
        labels = dataset.labels
        self.labels = None if labels is None else torch.from_numpy(labels).to(device)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.volumes)

    def batch(self, indices: np.ndarray) -> dict[str, Any]:
        """The same batch as ``dataset.__getitems__(indices)``, on the device."""
        ds = self.dataset
        items = ds.items[indices].astype(np.int64)
        d, h, w = ds.patch_shape
        crops = [
            self.volumes[item][z : z + d, y : y + h, x : x + w]
            for item, (z, y, x) in zip(items.tolist(), ds.origins[indices].tolist(), strict=True)
        ]
        on_device = torch.from_numpy(items).to(self.device)
        batch = {"image": torch.stack(crops)[:, None], "item": on_device}
        if self.labels is not None:
            batch["labels"] = self.labels[on_device]
        return batch


class DeviceLoader:
    """Batches of ``sampler``'s indices from :class:`DevicePatches`, like a DataLoader with
    ``drop_last=True`` (the trainer sets the sampler's epoch before each pass)."""

    def __init__(self, patches: DevicePatches, sampler: Any, batch_size: int) -> None:
        self.patches, self.sampler, self.batch_size = patches, sampler, batch_size

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = np.fromiter(iter(self.sampler), dtype=np.int64)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            yield self.patches.batch(order[start : start + self.batch_size])


def device_loader(
    dataset: Any, sampler: Any, batch_size: int, device: torch.device, mode: str
) -> tuple[DeviceLoader, LoaderPlan] | None:
    """A :class:`DeviceLoader` when ``mode`` asks for one ("on"), or when it is "auto", the
    device is CUDA and the dataset takes at most ``DEVICE_SHARE`` of its free memory; None
    when batches should come from a DataLoader."""
    if mode == "off" or not (isinstance(dataset, CTPatchDataset) and dataset.patch):
        return None
    size = dataset.nbytes()
    if mode == "auto":
        if device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(device)
        if size > DEVICE_SHARE * free:
            return None
        why = f"{size / 1e9:.2f} GB <= {DEVICE_SHARE:g} x {free / 1e9:.1f} GB free on {device}"
    else:
        why = f"{size / 1e9:.2f} GB, as configured"
    patches = DevicePatches(dataset, device)
    plan = LoaderPlan(
        0, None, False, False, None, [f"device cache: volumes held on {device} ({why})"]
    )
    plan.reasons.append("batches are cut on the device: no workers, no pinned copies")
    return DeviceLoader(patches, sampler, batch_size), plan
