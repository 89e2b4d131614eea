"""CT-RATE from the Hugging Face hub: its volumes become CT scans like any other source.

``hub_ct_catalog`` lists the split at a pinned commit and records every volume in the CT
catalog (location ``hf://datasets/<repo>@<commit>/<path>``, the LFS hash as its content
hash) and as a ``ct_scans`` partition, with CT-RATE's labels and reports beside them.  From
there a hub volume is built by the CT graph — raw scan → HU (downloaded on demand) → windows
→ sparse → patches → ``ct_dataset`` → the models — with no hub-only dead end.
"""

import dagster as dg
import numpy as np

from zarrfeed.assets.build import IO_POOL, OWNERS
from zarrfeed.assets.partitions import ct_scans
from zarrfeed.formats.discover import (
    read_ct_rate_labels,
    read_ct_rate_metadata,
    read_ct_rate_reports,
)
from zarrfeed.resources import HuggingFaceResource, ZarrStoreResource
from zarrfeed.sources.raw import hub_items, hub_origin
from zarrfeed.store import provenance

CATALOG_ASSET = "hub/catalog"
UNKNOWN_LABEL = 255


@dg.asset(
    group_name="hub",
    code_version="2",
    kinds={"huggingface", "zarr"},
    owners=OWNERS,
    tags={"family": "ct", "stage": "raw"},
    pool=IO_POOL,
    check_specs=[
        dg.AssetCheckSpec(
            "non_empty",
            asset="hub_ct_catalog",
            blocking=True,
            description="The listing found at least one volume.",
        )
    ],
)
def hub_ct_catalog(
    context: dg.AssetExecutionContext, hf: HuggingFaceResource, zarr_store: ZarrStoreResource
) -> dg.MaterializeResult:
    """The split's volumes at a pinned commit, recorded as CT scans (one ``ct_scans``
    partition each), with CT-RATE's labels and reports."""
    hub, store = hf.hub(), zarr_store.store()
    sha, volumes = hub.volumes()
    tables = {kind: hub.table(kind, sha) for kind in ("metadata", "labels", "reports")}
    metadata = read_ct_rate_metadata(tables["metadata"].parent) if tables["metadata"] else {}
    catalog = zarr_store.catalog("ct")
    changes = catalog.update(hub_origin(hub), hub_items(hub, sha, volumes, metadata))
    keys = sorted(volumes)
    for key in changes.conflicts:  # their partitions fail naming every path
        item = catalog.get(key)
        paths = [item.location, *item.conflict] if item else []
        context.log.warning(f"partition {key}: one key for {', '.join(paths)}")
    known = set(context.instance.get_dynamic_partitions(ct_scans.name))
    context.instance.add_dynamic_partitions(ct_scans.name, [k for k in keys if k not in known])
    names, rows = read_ct_rate_labels(tables["labels"].parent) if tables["labels"] else ([], {})
    reports = read_ct_rate_reports(tables["reports"].parent) if tables["reports"] else {}
    text = [reports.get(k, "") for k in keys]
    blob = "".join(text).encode()
    offsets = np.cumsum([0, *(len(t.encode()) for t in text)], dtype=np.int64)
    attrs = provenance(
        f"hf://datasets/{hf.repo_id}@{sha}",
        None,
        "2",
        {"split": hf.split, "revision": hf.revision},
        revision_sha=sha,
        keys=keys,
        label_names=names,
        unknown=UNKNOWN_LABEL,
    )
    with store.write_partition(CATALOG_ASSET, hf.split, attrs) as w:
        if names:
            table = [rows.get(k, [UNKNOWN_LABEL] * len(names)) for k in keys]
            labels = np.array(table, dtype=np.uint8).reshape(len(keys), len(names))
            w.write("labels", labels, read="whole")
        w.write(
            "reports_utf8",
            np.frombuffer(blob, dtype=np.uint8) if blob else np.zeros(1, np.uint8),
            read="whole",
        )
        w.write("reports_offsets", offsets, read="whole")
    return dg.MaterializeResult(
        metadata={
            "revision_sha": sha,
            "volumes": len(keys),
            "new": len(changes.new),
            "changed": len(changes.changed),
            "conflicts": len(changes.conflicts),
            "bytes_to_download": sum(v.size for v in volumes.values()),
            "labelled": sum(k in rows for k in keys),
            "with_report": sum(bool(t) for t in text),
        },
        check_results=[dg.AssetCheckResult(check_name="non_empty", passed=bool(keys))],
    )


def hub_labels(store) -> tuple[list[str], dict[str, list[int]]]:
    """CT-RATE labels of every hub split recorded in the store (names, key → row)."""
    names: list[str] = []
    rows: dict[str, list[int]] = {}
    for split in store.list_partitions(CATALOG_ASSET):
        attrs = store.commit_record(CATALOG_ASSET, split)["attrs"]
        if not attrs.get("label_names"):
            continue
        names = attrs["label_names"]
        table = store.read_array(CATALOG_ASSET, split, "labels")
        rows.update({k: list(map(int, r)) for k, r in zip(attrs["keys"], table, strict=True)})
    return names, rows
