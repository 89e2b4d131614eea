"""``zarrfeed verify [ASSET [KEY]]``, verification against the original: every
committed partition re-read and compared with what was recorded when it was built.

- each array opens with its recorded shape and dtype, and its content checksum
  (:mod:`zarrfeed.store.checksums`) matches the recorded one;
- a first-stage partition's raw source still hashes to the recorded ``source_sha256``;
- a later stage's partition was built from the upstream partitions committed now (their
  fingerprint and content digest, ``store.contract.identity``): one built from an upstream
  since rebuilt with other content no longer matches it, whatever its own checksums say.

A difference is a *mismatch*, named; a partition built before checksums were recorded, or
whose source is gone or cannot be read, is *unverified* and says why and what to do.  Either
exits 1: nothing unverified may pass for verified in a script.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from zarrfeed.commands.options import existing_store, families, reader_options
from zarrfeed.commands.output import print_json, print_table
from zarrfeed.commands.status import RESTORE
from zarrfeed.families import Family
from zarrfeed.sources.raw import is_hub, item_sha256, missing_source
from zarrfeed.store import ZarrStore
from zarrfeed.store.checksums import recorded_checksums
from zarrfeed.store.contract import SOURCE, StoredAsset, upstream_changed


@dataclass
class Finding:
    """The verdict on one partition."""

    asset: str
    key: str
    status: str  # ok | MISMATCH | unverified
    details: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "asset": self.asset,
            "key": self.key,
            "status": self.status,
            "details": self.details,
        }


def verify_partition(
    store: ZarrStore, family: Family, spec: StoredAsset, key: str, catalog: Any
) -> Finding:
    record = store.commit_record(spec.path, key)
    attrs = record["attrs"]
    sums, checksum = recorded_checksums(attrs)
    mismatches, notes, unsummed = [], [], []
    for name, meta in record["arrays"].items():
        try:
            data = store.read_array(spec.path, key, name)
        except Exception as exc:  # any decode or read failure is what verify reports
            mismatches.append(f"{name}: unreadable ({type(exc).__name__}: {exc})")
            continue
        if list(data.shape) != list(meta["shape"]) or str(data.dtype) != meta["dtype"]:
            mismatches.append(
                f"{name}: recorded {meta['dtype']} {meta['shape']}, read {data.dtype} "
                f"{list(data.shape)}"
            )
        elif name not in sums:
            unsummed.append(name)
        elif checksum(data) != sums[name]:
            mismatches.append(f"{name}: content checksum differs from the one recorded at build")
    if unsummed:
        notes.append(
            f"no checksum recorded for {', '.join(unsummed)} (built before checksums were; a "
            "forced rebuild adds them)"
        )
    if SOURCE in spec.inputs:
        mismatches += _source(family, key, attrs, catalog, notes)
    mismatches += _upstream(store, family, spec, key, attrs)
    status = "MISMATCH" if mismatches else ("unverified" if notes else "ok")
    return Finding(spec.name, key, status, mismatches + notes)


def _upstream(
    store: ZarrStore, family: Family, spec: StoredAsset, key: str, attrs: dict[str, Any]
) -> list[str]:
    """The upstream partitions committed now that are not the ones the partition was built
    from (a missing one is the upstream's own finding)."""
    upstream = {}
    for name in spec.upstream:
        up = family.stored(name)
        if store.has_partition(up.path, key):
            upstream[name] = store.commit_record(up.path, key)["attrs"]
    return [
        f"built from another build of {name} than the one committed now (its content or "
        f"fingerprint changed): build {spec.name} again"
        for name in upstream_changed(spec, attrs, upstream)
    ]


def _source(
    family: Family, key: str, attrs: dict[str, Any], catalog: Any, notes: list[str]
) -> list[str]:
    """The raw source against the recorded hash (mismatches; notes when it cannot be read)."""
    item = catalog.get(key)
    recorded = attrs.get("source_sha256")
    if item is None:
        notes.append(
            f"source: not in the catalog (gone?); remove with `zarrfeed partitions remove "
            f"{family.name} {key}`"
        )
        return []
    if is_hub(item):
        same = item.sha256 == recorded
        if not same:
            return [f"source: the hub lists sha256 {item.sha256}, built from {recorded}"]
        return []
    gone = missing_source(item)
    if gone is not None:
        notes.append(f"source: {gone}; {RESTORE.format(family=family.name, key=key)}")
        return []
    try:
        now = item_sha256(item, family.raw.files(item))
    except OSError as exc:
        notes.append(f"source: cannot be read ({exc})")
        return []
    if now != recorded:
        return [
            f"source: {item.location} changed since the build (sha256 {now[:12]}…, built "
            f"from {str(recorded)[:12]}…)"
        ]
    return []


def verify(
    store: ZarrStore,
    specs: list[tuple[Family, StoredAsset]],
    catalogs: dict[str, Any],
    key: str | None = None,
) -> list[Finding]:
    """Findings for every committed partition of ``specs`` (or only ``key``)."""
    out = []
    for family, spec in specs:
        keys = [key] if key else store.list_partitions(spec.path)
        for k in keys:
            out.append(verify_partition(store, family, spec, k, catalogs[family.name]))
    return out


def add_parser(sub: Any) -> None:
    p = sub.add_parser("verify", help="re-check partitions against checksums and raw sources")
    p.add_argument("asset", nargs="?", help="only this stored asset")
    p.add_argument("key", nargs="?", help="only this partition")
    reader_options(p, main, instance=False)


def main(args: argparse.Namespace) -> int:
    from zarrfeed.commands.inspect import resolve
    from zarrfeed.resources import ZarrStoreResource

    existing_store(args.store)
    resource = ZarrStoreResource(url=args.store)
    declared = [c.declaration for c in families()]
    specs = [(f, spec) for f in declared for spec in f.assets]
    if args.asset:
        wanted = resolve(args.asset, [spec for _, spec in specs])
        specs = [(f, spec) for f, spec in specs if spec is wanted]
    catalogs = {f.name: resource.catalog(f.name) for f in declared}
    findings = verify(resource.store(), specs, catalogs, args.key)
    bad = [f for f in findings if f.status == "MISMATCH"]
    unverified = [f for f in findings if f.status == "unverified"]
    if args.json:
        print_json([f.to_json() for f in findings])
    else:
        print_table(
            ["asset", "key", "status", "details"],
            [[f.asset, f.key, f.status, "; ".join(f.details)] for f in findings],
            title=f"verify {resource.url}",
            notes=[
                f"{len(findings)} partitions: {len(bad)} mismatched, {len(unverified)} unverified"
            ],
        )
    return 1 if bad or unverified else 0
