"""A family step's partitions, built the same way in the step's threads or in worker processes.

:func:`stage_builds` is what building one partition of a step means (its chosen stages in
order, a failure stopping the rest).  :func:`build_in_worker` runs it in a worker process
(``zarrfeed.workerpool``) from a :class:`StageJob` — the family, its settings and the
resources' configuration, never data: a worker reads its inputs from the store, commits its
partitions there itself, and sends back only what Dagster records (metadata, checks, data
version), which the step records as each partition ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from zarrfeed.assets.build import Built, build_partition, partition_error
from zarrfeed.families import Family, Inputs, Stage
from zarrfeed.resources import HuggingFaceResource, ZarrStoreResource
from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import is_hub
from zarrfeed.store import ZarrStore


class HubFetch:
    """Raw items of the family's hub source, downloaded on demand; with the hub resource's
    ``delete_after_commit``, each download goes once its partition is committed."""

    def __init__(self, hf: Any) -> None:
        self.hf, self._hub = hf, None

    def hub(self) -> Any:
        if self._hub is None:
            self._hub = self.hf.hub()
        return self._hub

    def local(self, item: RawItem) -> Path:
        if not is_hub(item):
            return Path(item.location)
        return self.hub().download(item.detail["path"], item.detail["commit"])

    def forget(self, path: Path) -> None:
        if self.hf.delete_after_commit:
            self.hub().forget(path)


def stage_builds(
    inputs: Inputs,
    store: ZarrStore,
    stages: Sequence[Stage],
    values: Mapping[str, Any],
    force: bool,
    partition: str,
) -> Iterator[tuple[dg.AssetKey, Built]]:
    """The ``stages`` of ``partition``, in order (a failure stops the rest)."""
    for stage in stages:
        step = stage.build(inputs, partition)
        built = build_partition(store, stage.asset, partition, values, force, step)
        yield dg.AssetKey(stage.asset.name), built
    inputs.done(partition)


@dataclass(frozen=True)
class StageJob:
    """What a worker process needs to build partitions of a family step: small and
    picklable (the family declaration pickles by reference to its module's functions)."""

    family: Family
    values: dict[str, Any]
    stages: tuple[str, ...]  # asset names of the stages to build, in order
    store: dict[str, Any]  # ZarrStoreResource's configuration
    hf: dict[str, Any] | None  # HuggingFaceResource's, for a family with a hub source
    force: bool
    threads: int  # intra-op threads for torch: the cores are shared with the other workers


def configured(resource: dg.ConfigurableResource) -> dict[str, Any]:
    """The configuration of ``resource`` as plain values: a resource object does not
    survive pickling (its Dagster config schema does not unpickle)."""
    return {name: getattr(resource, name) for name in type(resource).model_fields}


_opened: list[Any] = []  # this worker process's job and what it opened for it


def _open(job: StageJob) -> tuple[Inputs, ZarrStore, list[Stage]]:
    """The inputs, store and stages of ``job``, opened once per worker process."""
    if not _opened or _opened[0] != job:
        import torch

        torch.set_num_threads(job.threads)
        resource = ZarrStoreResource(**job.store)
        store = resource.store()
        fetch = HubFetch(HuggingFaceResource(**job.hf)) if job.hf is not None else None
        inputs = Inputs(job.family, store, resource.catalog(job.family.name), job.values, fetch)
        stages = [s for name in job.stages for s in job.family.stages if s.asset.name == name]
        _opened[:] = [job, (inputs, store, stages)]
    return _opened[1]


def build_in_worker(job: StageJob, key: str) -> tuple[list[tuple[str, Built]], str | None]:
    """Partition ``key`` of ``job``'s stages in this worker process: what each stage built
    (asset name, :class:`Built`), and why the partition failed (None when it did not)."""
    out: list[tuple[str, Built]] = []
    try:
        inputs, store, stages = _open(job)
        for asset, built in stage_builds(inputs, store, stages, job.values, job.force, key):
            out.append((asset.to_user_string(), built))
    except Exception as exc:
        return out, partition_error(exc)
    return out, None
