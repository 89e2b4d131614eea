"""Materialise every family of a raw folder into a store: ``python build_sample_store.py RAW
STORE DAGSTER_HOME``.  Small CT settings (2 mm voxels, 16×32×32 patches, 32³ occupancy grids:
the occupancy autoencoder's step is ~8× cheaper than on 64³) keep it and its training quick."""

import sys
from pathlib import Path

import dagster as dg
from graph import FAMILIES, base_resources, build, build_datasets, discover

from zarrfeed.families.ct import CTSettings
from zarrfeed.resources import ModelsResource, RawFolderResource, ZarrStoreResource


def main(raw: str, store: str, home: str) -> None:
    resources = {
        **base_resources(),
        "zarr_store": ZarrStoreResource(url=store),
        "raw": RawFolderResource(root=raw),
        "models": ModelsResource(root=str(Path(home) / "models")),
        "ct_settings": CTSettings(
            spacing_zyx_mm=[2.0, 2.0, 2.0],
            windows=["lung", "bone"],
            patch_zyx=[16, 32, 32],
            patch_stride_zyx=[16, 32, 32],
            sparse_grid=32,
        ),
    }
    Path(home).mkdir(parents=True, exist_ok=True)
    with dg.instance_for_test(temp_dir=home) as instance:
        for family in FAMILIES:
            for key in discover(instance, resources, family):
                build(resources, instance, family, key)
        build_datasets(resources, instance)


if __name__ == "__main__":
    main(*sys.argv[1:4])
