"""``zarrfeed datasets list [NAME]``: the retained versions of each dataset — id, when, keys,
bytes, the bytes only retention keeps, and the models trained on each — so that any of them
can be trained on again (``zarrfeed train --dataset-version ID``) while it is retained."""

from __future__ import annotations

import argparse
import time
from typing import Any

from zarrfeed.commands.options import existing_store, reader_options
from zarrfeed.commands.output import human_bytes, print_json, print_table
from zarrfeed.datasets import dataset_versions, snapshots


def add_parser(sub: Any) -> None:
    p = sub.add_parser("datasets", help="dataset versions: retained, current, models trained on")
    verbs = p.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="the retained versions of each dataset")
    listing.add_argument("name", nargs="?", help="only this dataset (ct, spike, images)")
    reader_options(listing, main)


def trained_models(instance: Any) -> dict[str, list[str]]:
    """Dataset version id → the model assets whose materialisations read it (their input
    data version of the dataset, which is the version's id)."""
    import dagster as dg

    from zarrfeed.training.tasks import TASK_TYPES, model_asset_name

    out: dict[str, list[str]] = {}
    for task, kind in TASK_TYPES.items():
        dataset = kind.family.dataset_asset
        result = instance.fetch_materializations(dg.AssetKey(model_asset_name(task)), limit=100)
        for record in result.records:
            tags = record.asset_materialization.tags or {}
            version = tags.get(f"dagster/input_data_version/{dataset}")
            if version and model_asset_name(task) not in out.get(version, []):
                out.setdefault(version, []).append(model_asset_name(task))
    return out


def main(args: argparse.Namespace) -> int:
    from zarrfeed.commands.instance import home_of, open_instance

    store = existing_store(args.store)
    names = [args.name] if args.name else snapshots(store).datasets()
    home = home_of(args.dagster_home)
    instance = open_instance(home) if home else None
    try:
        models = trained_models(instance) if instance else {}
    finally:
        if instance is not None:
            instance.dispose()
    found = {name: dataset_versions(store, name) for name in names}
    if args.json:
        print_json({n: [{**v, "models": models.get(v["id"], [])} for v in vs]
                    for n, vs in found.items()})  # fmt: skip
        return 0
    rows = [
        [
            name,
            v["id"] + (" (current)" if v["current"] else ""),
            time.strftime("%Y-%m-%d %H:%M", time.gmtime(v["created_unix"] or 0)),
            str(v["keys"]),
            human_bytes(v["stored_bytes"]),
            human_bytes(v["retained_bytes"]),
            ", ".join(models.get(v["id"], [])) or "-",
        ]
        for name, versions in found.items()
        for v in versions
    ]
    retained = sum(v["retained_bytes"] for vs in found.values() for v in vs)
    print_table(
        ["dataset", "version", "created (UTC)", "keys", "stored", "only retained", "models"],
        rows,
        title=f"dataset versions in {store.url}",
        notes=[
            f"{human_bytes(retained)} held only by retained versions (the nightly "
            "store_maintenance frees them once past retention)"
        ],
    )
    return 0
