"""The data contract's types and rules: what a stored asset declares, and when a partition
is current.

A :class:`StoredAsset` says where its partitions live in the store, which arrays they hold
(dims, dtype, how training reads them), its code version, which settings and which inputs make
up a partition's *fingerprint*, and its blocking checks.  The declarations themselves are the
families' (``zarrfeed.families``); Dagster assets, the build routine, manifests, the nightly
schedules and training's readers all derive from them, and share one notion of "out of date":

    a partition is current when its committed fingerprint equals the fingerprint computed now
    from the asset's code version, the settings it declares, and its inputs (the raw item's
    content hash and evidence for the first stage, the upstream partitions' *identities* —
    fingerprint and content digest, :func:`identity` — for the others).

Fingerprints hash inputs, and an upstream rebuilt with other content under the same
fingerprint (a forced rebuild after a library upgrade, a healed corruption that the derived
stage had read) must still make what was built from it stale: hence the content digest.

Settings are plain values here, so this module imports no Dagster.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zarrfeed.store.codecs import Content, Read

SOURCE = "source"  # the input name of the raw item (its content hash and evidence)
# The partition attribute naming the identity (:func:`identity`) of each upstream partition
# it was built from (the name is older than the content digest in it).
UPSTREAM = "upstream_fingerprints"
# The partition attribute holding one digest of its arrays' recorded content checksums.
CONTENT = "content_digest"


@dataclass(frozen=True)
class ArraySpec:
    """One array of a partition; ``per`` names a list setting with one array per entry
    (CT windows), so the array's name is the entry."""

    name: str
    dims: tuple[str, ...]
    dtype: str | tuple[str, ...]  # one dtype, or those allowed (images keep their depth)
    read: Read = "patch"
    content: Content = "dense"
    per: str | None = None


@dataclass(frozen=True)
class Check:
    """A blocking check of a stored asset's partitions: a partition failing one is committed
    for inspection but never enters a dataset."""

    name: str
    description: str  # what it verifies, shown in the UI next to each result


@dataclass(frozen=True)
class StoredAsset:
    """An asset whose partitions are committed to the store."""

    name: str  # the Dagster asset key
    path: str  # the store path of its partitions
    family: str
    version: str  # bump whenever the builder's output for the same inputs changes
    arrays: tuple[ArraySpec, ...]
    description: str
    params: tuple[str, ...] = ()  # settings that shape every partition
    # Of ``params``, those training's readers take once per dataset (a patch size, a grid, a
    # binning), not per partition: a dataset never mixes partitions built with two values.
    per_dataset: tuple[str, ...] = ()
    keyed_params: tuple[str, ...] = ()  # mappings of settings by partition key (overrides)
    inputs: tuple[str, ...] = (SOURCE,)  # SOURCE and/or names of upstream stored assets
    checks: tuple[Check, ...] = ()  # blocking: a partition failing one never enters a dataset
    kinds: frozenset[str] = frozenset({"zarr", "numpy"})

    def __post_init__(self) -> None:
        undeclared = [p for p in self.per_dataset if p not in self.params]
        if undeclared:
            raise ValueError(f"{self.name}: per_dataset {undeclared} are not among its params")

    def settings_of(self, settings: Mapping[str, Any], key: str | None = None) -> dict[str, Any]:
        """The declared settings (and, with ``key``, that partition's keyed settings)."""
        missing = [p for p in (*self.params, *self.keyed_params) if p not in settings]
        if missing:
            raise KeyError(f"{self.name}: settings lack {missing}")
        out = {p: plain(settings[p]) for p in self.params}
        if key is not None:
            out |= {p: plain((settings[p] or {}).get(key)) for p in self.keyed_params}
        return out

    def code_version(self, settings: Mapping[str, Any]) -> str:
        """The code version Dagster sees: the builder's version and a hash of the settings,
        so a changed setting makes exactly the assets that declare it stale in the UI."""
        if not self.params:
            return self.version
        return f"{self.version}.{_digest(self.settings_of(settings))[:8]}"

    def fingerprint(self, settings: Mapping[str, Any], key: str, inputs: Mapping[str, Any]) -> str:
        """A hash of everything partition ``key``'s content depends on."""
        missing = [i for i in self.inputs if i not in inputs]
        if missing:
            raise KeyError(f"{self.name}[{key}]: inputs lack {missing}")
        wanted = {i: inputs[i] for i in self.inputs}
        return _digest([self.version, self.settings_of(settings, key), wanted])[:32]

    def array_names(self, settings: Mapping[str, Any]) -> list[str]:
        names: list[str] = []
        for spec in self.arrays:
            names.extend(settings[spec.per] if spec.per else [spec.name])
        return names

    @property
    def check_names(self) -> list[str]:
        return [c.name for c in self.checks]

    @property
    def upstream(self) -> list[str]:
        """The stored assets whose partitions this one reads (its inputs but the source)."""
        return [i for i in self.inputs if i != SOURCE]

    def array(self, name: str) -> ArraySpec:
        """The spec of array ``name`` (a window name finds its ``per`` spec)."""
        for spec in self.arrays:
            if spec.name == name or spec.per:
                return spec
        raise KeyError(f"{self.name} declares no array {name!r}")


def content_digest(checksums: Mapping[str, str]) -> str:
    """One digest of a partition's array checksums (name → checksum, any hash): what a
    stage built from the partition takes into its fingerprint, so it changes with any array's
    content, and nothing is read to compute it."""
    return _digest(sorted(checksums.items()))[:32]


def identity(fingerprint: str, digest: str | None) -> str:
    """What a stage records of (and fingerprints) an upstream partition it is built from: its
    fingerprint and content digest.  A partition committed before digests were recorded is
    its fingerprint alone, so what was built from it stays current until it is rebuilt."""
    return f"{fingerprint}+{digest}" if digest else fingerprint


def identity_of(attrs: Mapping[str, Any]) -> str | None:
    """The :func:`identity` of a committed partition from its attributes (or a summary's)."""
    fingerprint = attrs.get("fingerprint")
    return None if fingerprint is None else identity(fingerprint, attrs.get(CONTENT))


def upstream_changed(
    spec: StoredAsset, attrs: Mapping[str, Any], upstream: Mapping[str, Mapping[str, Any] | None]
) -> list[str]:
    """The stages ``spec``'s partition (``attrs``) reads whose committed partition
    (``upstream``: stage name → its attributes) is not the one it was built from.
    Partitions that do not record what they were built from are taken as they are."""
    changed = []
    for up in spec.upstream:
        built_from = (attrs.get(UPSTREAM) or {}).get(up)
        now = identity_of(upstream.get(up) or {})
        if built_from is not None and now is not None and now != built_from:
            changed.append(up)
    return changed


def stale_reason(record: Mapping[str, Any] | None, expected: str) -> str | None:
    """Why a partition with commit ``record`` is out of date, or None when it is current.

    The one rule behind reuse, the nightly rebuild and ``zarrfeed status``.  A partition that
    failed its checks is current if nothing changed: building it again would fail again.
    """
    if record is None:
        return "missing"
    if record.get("attrs", {}).get("fingerprint") != expected:
        return "inputs, settings or code changed since the last build"
    return None


def failed_checks(record: Mapping[str, Any] | None) -> list[str]:
    """The blocking checks a committed partition failed (it never enters a dataset)."""
    return sorted(n for n, ok in ((record or {}).get("checks") or {}).items() if not ok)


def plain(value: Any) -> Any:
    """Settings as JSON-stable values (tuples and lists hash alike)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
