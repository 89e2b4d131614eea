"""Materialise every family of a raw folder into a store: ``python build_sample_store.py RAW
STORE DAGSTER_HOME``.  Small CT settings (2 mm voxels, 16×32×32 patches) keep it quick."""

import sys
from pathlib import Path

import dagster as dg

from zarrfeed.assets import all_assets, dataset_assets
from zarrfeed.definitions import RESOURCES
from zarrfeed.resources import CTSettings, RawFolderResource, ZarrStoreResource


def main(raw: str, store: str, home: str) -> None:
    resources = {
        **RESOURCES,
        "zarr_store": ZarrStoreResource(url=store),
        "raw": RawFolderResource(root=raw),
        "ct_settings": CTSettings(
            spacing_zyx_mm=[2.0, 2.0, 2.0],
            windows=["lung", "bone"],
            patch_zyx=[16, 32, 32],
            patch_stride_zyx=[16, 32, 32],
        ),
    }
    found = {
        "ct_scans": resources["raw"].ct_scans(),
        "spike_sequences": resources["raw"].spike_sequences(),
        "image_sets": resources["raw"].image_sets(),
    }
    Path(home).mkdir(parents=True, exist_ok=True)
    with dg.instance_for_test(temp_dir=home) as instance:
        for name, keys in found.items():
            instance.add_dynamic_partitions(name, sorted(keys))
            assets = [a for a in all_assets if a.partitions_def and a.partitions_def.name == name]
            for key in sorted(keys):
                dg.materialize(assets, partition_key=key, resources=resources, instance=instance)
        dg.materialize(dataset_assets, resources=resources, instance=instance)


if __name__ == "__main__":
    main(*sys.argv[1:4])
