"""CT-RATE from the Hugging Face hub: its volumes become raw items like any other source.

The hub asset of a family that declares a hub source lists the split at a pinned commit and
records every volume in the family's catalog (location ``hf://datasets/<repo>@<commit>/<path>``,
the LFS hash as its content hash) and as a partition, with CT-RATE's labels and reports
beside them.  From there a hub volume is built by the family's graph — raw scan → HU
(downloaded on demand) → windows → sparse → patches → the dataset → the models — with no
hub-only dead end.
"""

import dagster as dg
import numpy as np

from zarrfeed.assets.build import IO_POOL, OWNERS
from zarrfeed.assets.partitions import partitions_def
from zarrfeed.families import Family
from zarrfeed.families.ct.tables import (
    UNKNOWN_LABEL,
    read_ct_rate_labels,
    read_ct_rate_metadata,
    read_ct_rate_reports,
)
from zarrfeed.resources import HuggingFaceResource, ZarrStoreResource
from zarrfeed.sources.raw import hub_items, hub_origin
from zarrfeed.store import provenance


def hub_asset(family: Family) -> dg.AssetsDefinition:
    """The hub listing of ``family`` (its ``hub`` declaration): volumes become partitions."""
    source = family.hub
    if source is None:
        raise ValueError(f"{family.name} declares no hub source")

    @dg.asset(
        name=source.asset,
        group_name="hub",
        code_version=source.version,
        kinds={"huggingface", "zarr"},
        owners=OWNERS,
        tags={"family": family.name, "stage": "raw"},
        pool=IO_POOL,
        check_specs=[
            dg.AssetCheckSpec(
                source.check.name,
                asset=source.asset,
                blocking=True,
                description=source.check.description,
            )
        ],
    )
    def _hub(
        context: dg.AssetExecutionContext, hf: HuggingFaceResource, zarr_store: ZarrStoreResource
    ) -> dg.MaterializeResult:
        """The split's volumes at a pinned commit, recorded as raw items (one partition
        each), with CT-RATE's labels and reports."""
        return list_hub(context, family, hf, zarr_store)

    return _hub


def list_hub(
    context: dg.AssetExecutionContext,
    family: Family,
    hf: HuggingFaceResource,
    zarr_store: ZarrStoreResource,
) -> dg.MaterializeResult:
    source, partitions = family.hub, partitions_def(family)
    hub, store = hf.hub(), zarr_store.store()
    sha, volumes = hub.volumes()
    tables = {kind: hub.table(kind, sha) for kind in ("metadata", "labels", "reports")}
    metadata = read_ct_rate_metadata(tables["metadata"].parent) if tables["metadata"] else {}
    catalog = zarr_store.catalog(family.name)
    changes = catalog.update(hub_origin(hub), hub_items(hub, sha, volumes, metadata))
    keys = sorted(volumes)
    for key in changes.conflicts:  # their partitions fail naming every path
        item = catalog.get(key)
        paths = [item.location, *item.conflict] if item else []
        context.log.warning(f"partition {key}: one key for {', '.join(paths)}")
    known = set(context.instance.get_dynamic_partitions(partitions.name))
    context.instance.add_dynamic_partitions(partitions.name, [k for k in keys if k not in known])
    names, rows = read_ct_rate_labels(tables["labels"].parent) if tables["labels"] else ([], {})
    reports = read_ct_rate_reports(tables["reports"].parent) if tables["reports"] else {}
    text = [reports.get(k, "") for k in keys]
    blob = "".join(text).encode()
    offsets = np.cumsum([0, *(len(t.encode()) for t in text)], dtype=np.int64)
    attrs = provenance(
        f"hf://datasets/{hf.repo_id}@{sha}",
        None,
        source.version,
        {"split": hf.split, "revision": hf.revision},
        revision_sha=sha,
        keys=keys,
        label_names=names,
        unknown=UNKNOWN_LABEL,
    )
    with store.write_partition(source.path, hf.split, attrs) as w:
        if names:
            table = [rows.get(k, [UNKNOWN_LABEL] * len(names)) for k in keys]
            labels = np.array(table, dtype=np.uint8).reshape(len(keys), len(names))
            w.write(source.labels, labels, read="whole")
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
        check_results=[dg.AssetCheckResult(check_name=source.check.name, passed=bool(keys))],
    )
