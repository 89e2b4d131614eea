"""A data family, declared once: everything else about it derives from the declaration.

A :class:`Family` (CT scans, spike sequences, image sets, or one of your own) names

- its raw items (:class:`RawSource`): how discovery finds them under a raw folder without
  reading a file, which files each one reads, and the facts its raw-ingest asset reports;
- its settings: a pydantic model whose values shape the stored partitions (a component's
  YAML gives them; code versions and fingerprints both derive from the same values);
- its stages (:class:`Stage`): the stored assets of the data contract — store path, arrays,
  code version, fingerprint inputs, blocking checks — in dependency order, each with the
  builder of one partition;
- its dataset: the manifest of the keys complete in every stage, the consolidated
  :class:`Table` s training reads, and :class:`Extra` tables from outside the stores;
- its training readers (:class:`Reader`), training tasks (``module:Class`` of each,
  found by training through :mod:`zarrfeed.families.registry`) and augmentation recipes,
  and optionally a hub source of raw items.

The Dagster assets, checks, dependencies, jobs, discovery sensors and nightly schedules
(``zarrfeed.assets``, ``zarrfeed.jobs``, ``zarrfeed.components``), the manifests, the CLI's
commands and training's readers take their names, paths and versions from here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from zarrfeed.families.stages import Inputs, Step
from zarrfeed.formats.walk import Tree
from zarrfeed.sources.catalog import RawItem
from zarrfeed.sources.raw import Scan, source_identity
from zarrfeed.store import ZarrStore
from zarrfeed.store.contract import CONTENT, SOURCE, Check, StoredAsset, identity, stale_reason
from zarrfeed.store.layout import dataset_path

# item -> (metadata, readable?, facts for the readable check)
RawFacts = tuple[dict[str, Any], bool, dict[str, Any]]
Builder = Callable[[Inputs, str], Step]  # (inputs, partition key) -> how to build it


def claims_nothing(tree: Tree) -> list[Path]:
    """The default claim: no folder (a module function, so a declaration pickles into the
    worker processes that build full-size items)."""
    return []


@dataclass(frozen=True)
class RawSource:
    """A family's raw items, as discovery finds them and its raw-ingest asset reports them."""

    asset: str  # the raw-ingest asset: each item's content hash (its data version) and facts
    items: str  # what its items are, in a sentence ("CT scans")
    description: str
    kinds: frozenset[str]  # the formats it reads (kinds in the UI)
    # (absolute raw root, its walk less the folders other families claim) -> key -> catalog
    # entry, no file read
    scan: Callable[[str, Tree], Scan]
    files: Callable[[RawItem], list[Path]]  # every local file one item reads, stable order
    describe: Callable[[RawItem], RawFacts]
    readable: Check  # the raw-ingest asset's blocking check
    version: str = "1"  # bump when the facts reported for the same item change
    # Peak memory building one item takes per byte of the raw item (its decoded arrays and
    # their intermediates): how many items a batched run builds at once.
    memory_per_byte: float = 16.0
    # The folders of a walk this family owns with everything under them (a spike dataset's
    # frames are no image sets): other families' discovery does not see them.
    claims: Callable[[Tree], list[Path]] = claims_nothing


@dataclass(frozen=True)
class Stage:
    """A stored asset and the builder of one of its partitions.  Stages naming the same
    ``step`` are built in one Dagster step (any subset of them), from one read of what they
    share."""

    asset: StoredAsset
    build: Builder
    step: str | None = None


@dataclass(frozen=True)
class Table:
    """Arrays of one stored asset over every key of the dataset, concatenated as partition
    ``name`` of the dataset (with an ``offsets`` array): a reader opens one group, not one
    per partition."""

    name: str
    asset: StoredAsset
    arrays: tuple[str, ...]


@dataclass(frozen=True)
class Extra:
    """A dataset table made from outside the stores (CT-RATE's labels):
    ``write(store, raw root, keys, dataset path)`` commits partition ``name`` of the dataset
    aligned with ``keys`` and returns its facts (which enter the dataset's data version)."""

    name: str
    write: Callable[[ZarrStore, str, list[str], str], dict[str, Any]]


@dataclass(frozen=True)
class HubSource:
    """Raw items listed from a dataset repository on the Hugging Face hub."""

    asset: str  # lists the repository at a pinned commit into the family's catalog
    job: str  # the job that runs the listing
    path: str  # store path of the listing's tables (labels, reports), one partition per split
    version: str
    check: Check
    labels: str  # the listing's label table (CT-RATE's findings), read into the dataset


@dataclass(frozen=True)
class Reader:
    """A training dataset over the family's manifest, named by import path
    (``module:Class``): training imports the family, never the other way round."""

    name: str  # as ``zarrfeed benchmark-loader --dataset`` names it
    dataset: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def load(self) -> Any:
        return import_reference(self.dataset)


def import_reference(reference: str) -> Any:
    """What ``module:NAME`` names; an error naming the reference when there is no such
    thing."""
    module, sep, name = reference.partition(":")
    if not (sep and module and name):
        raise ValueError(f"{reference!r}: expected module:NAME")
    found = getattr(importlib.import_module(module), name, None)
    if found is None:
        raise ValueError(f"{reference!r}: {module} has no {name}")
    return found


@dataclass(frozen=True, eq=False)  # one object per family: compared and hashed by identity
class Family:
    """A kind of raw item and everything built from it, partition by partition."""

    name: str  # also the dataset's name and the Dagster group's
    partitions: str  # the dynamic partitions definition: one partition per raw item
    raw: RawSource
    settings: type[BaseModel]
    stages: tuple[Stage, ...]
    tables: tuple[Table, ...] = ()
    extras: tuple[Extra, ...] = ()
    dataset_version: str = "1"  # bump when the manifest asset's output changes
    hub: HubSource | None = None
    readers: tuple[Reader, ...] = ()
    # Its training tasks by import path (``module:Class``): the declaration imports no
    # training code, and training names no family.
    tasks: tuple[str, ...] = ()
    # Named augmentation recipes for its batches (``data.augment: {recipe: NAME}``): each
    # maps operation names to their defaults (``zarrfeed.transforms.augment.ops``), ``keys``
    # to each batch key's role, and optionally ``spatial_dims``.
    augment: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for stage in self.stages:
            spec = stage.asset
            late = [i for i in spec.upstream if i not in seen]
            if late:
                raise ValueError(f"{self.name}: {spec.name} reads {late}, declared after it")
            seen.add(spec.name)
        for table in self.tables:
            if table.asset.name not in seen:
                raise ValueError(f"{self.name}: table {table.name} of undeclared {table.asset}")

    # -- derived names ------------------------------------------------------------------
    @property
    def assets(self) -> tuple[StoredAsset, ...]:
        """Its stored assets, each after the ones it reads."""
        return tuple(stage.asset for stage in self.stages)

    @property
    def dataset_path(self) -> str:
        """Where the dataset's tables are stored (the manifest is named after the family)."""
        return dataset_path(self.name)

    @property
    def dataset_asset(self) -> str:
        return f"{self.name}_dataset"

    @property
    def build_job(self) -> str:
        return f"{self.name}_build"

    @property
    def dataset_job(self) -> str:
        return f"{self.dataset_asset}_build"

    @property
    def nightly(self) -> str:
        return f"{self.name}_nightly"

    @property
    def discovery(self) -> str:
        return f"{self.name}_discovery"

    def stored(self, name: str) -> StoredAsset:
        """The stored asset ``name`` (its Dagster name or its store path)."""
        for spec in self.assets:
            if name in (spec.name, spec.path):
                return spec
        raise KeyError(f"{self.name} has no stored asset {name!r}")

    def table(self, name: str) -> Table:
        return next(t for t in self.tables if t.name == name)

    def upstream_keys(self, spec: StoredAsset) -> list[str]:
        """The Dagster assets ``spec`` depends on: the raw asset for the source, else the
        stored assets it reads."""
        return [self.raw.asset if i == SOURCE else i for i in spec.inputs]

    # -- settings and freshness -----------------------------------------------------------
    def values(self, settings: BaseModel | Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Settings as plain values, validated by the family's model (defaults filled in)."""
        if isinstance(settings, BaseModel):
            settings = settings.model_dump()
        return self.settings.model_validate(dict(settings or {})).model_dump()

    def expected(
        self,
        settings: Mapping[str, Any],
        key: str,
        source: Mapping[str, Any],
        committed: Mapping[str, Mapping[str, Any] | None] | None = None,
    ) -> dict[str, str]:
        """The fingerprint each stored asset's partition ``key`` should have now, given the
        raw item's identity ``source`` (assets in dependency order).

        A stage built from another's takes that partition's content digest into its
        fingerprint: ``committed`` (asset name → the partition's record summary) gives it
        where the committed partition is current (otherwise it will be rebuilt, and what is
        built from it with it); without, upstream content is taken as unknown."""
        out: dict[str, str] = {}
        built: dict[str, str] = {}  # asset name -> its identity, an input of the next stages
        for spec in self.assets:
            inputs = {i: (source if i == SOURCE else built[i]) for i in spec.inputs}
            out[spec.name] = fingerprint = spec.fingerprint(settings, key, inputs)
            attrs = ((committed or {}).get(spec.name) or {}).get("attrs") or {}
            current = attrs.get("fingerprint") == fingerprint
            built[spec.name] = identity(fingerprint, attrs.get(CONTENT) if current else None)
        return out

    def out_of_date(
        self,
        store: ZarrStore,
        settings: Mapping[str, Any],
        keys: list[str],
        index: Mapping[str, RawItem],
    ) -> dict[str, str]:
        """Partition key -> why it needs a build, for every key of ``keys`` that does.

        The one meaning of out of date (``zarrfeed.store.contract.stale_reason``), shared by
        the nightly schedule and ``zarrfeed status``.  It reads the catalog ``index`` and the
        commit-record summaries of each stored asset (one listing, then only the records that
        changed since the last call) — no raw file is read or hashed — so it stays cheap at
        tens of thousands of partitions, also on an object store.  Keys without a source of
        their own (no catalog entry, or one claimed twice) are left to discovery's reports.
        """
        records = {spec.name: store.record_summaries(spec.path) for spec in self.assets}
        first = [s for s in self.assets if SOURCE in s.inputs]
        reasons = {}
        for key in keys:
            item = index.get(key)
            if item is None or item.conflict:
                continue
            head = records[first[0].name].get(key)
            if head is None:
                reasons[key] = f"{first[0].name} missing"
                continue
            if any(
                (records[s.name].get(key) or {}).get("attrs", {}).get("source_stamp") != item.stamp
                for s in first
            ):
                reasons[key] = "raw item changed"
                continue
            source = source_identity(item, head["attrs"]["source_sha256"])
            committed = {s.name: records[s.name].get(key) for s in self.assets}
            expected = self.expected(settings, key, source, committed)
            for spec in self.assets:
                why = stale_reason(records[spec.name].get(key), expected[spec.name])
                if why:
                    reasons[key] = f"{spec.name}: {why}"
                    break
        return reasons
