"""Issue 13's scenario: every CT source through one graph; each bad item fails alone, naming
its file; nothing bad reaches a manifest; HU is right for every good item."""

import numpy as np
import pytest
from graph import build, discover, failure, materialize

from zarrfeed.assets.datasets import dataset_asset
from zarrfeed.datasets import read_manifest
from zarrfeed.families.ct import CT
from zarrfeed.samples import make_ct_faults, make_ct_sources

GOOD = {  # key -> (HU decided by, intercept it applied)
    "train_1_a_1": ("csv", -1024.0),
    "ct-sources_dicom_patient_1_CT": ("dicom", 0.0),  # the reader applied each slice's tags
    "volume_1": ("sidecar", 0.0),
    "scaled_1": ("nifti_header", -1024.0),
}
BAD = {
    "all_air": "all_air.nii.gz",
    "twin_scan": "twin scan.nii.gz",
    "hostile": "hostile.nii",
}


@pytest.mark.slow
def test_every_ct_source_feeds_one_graph_and_bad_items_fail_alone(dagster_env):
    raw, resources, instance = dagster_env
    rng = np.random.default_rng(7)
    list(make_ct_sources(raw / "ct-sources", "small", rng))
    list(make_ct_faults(raw / "ct-sources", "small", rng))
    keys = discover(instance, resources, "ct")
    assert set(GOOD) | set(BAD) <= set(keys)
    store = resources["zarr_store"].store()
    for key in [*GOOD, *BAD]:
        result = build(resources, instance, "ct", key, raise_on_error=False)
        if key in GOOD:
            assert result.success, failure(result)
            decision = store.commit_record("ct/hu", key)["attrs"]["hu_rescale"]
            assert (decision["decided_by"], decision["intercept"]) == GOOD[key], decision
            hu = store.read_array("ct/hu", key, "hu")
            counts, edges = np.histogram(hu, bins=np.arange(-1100, 200, 50))
            assert -1050 <= edges[np.argmax(counts)] <= -900  # the air peak is at -1000 HU
            assert ((hu > -100) & (hu < 100)).mean() > 0.05  # soft tissue where it belongs
        else:
            assert not result.success and BAD[key] in failure(result), key
            assert not store.has_partition("ct/hu", key)
    assert "twin_scan.nii.gz" in failure(
        build(resources, instance, "ct", "twin_scan", raise_on_error=False)
    )  # both files named
    assert materialize([dataset_asset(CT)], instance, resources=resources).success
    manifest = read_manifest(store, "ct")
    assert set(GOOD) <= set(manifest["keys"]) and not set(BAD) & set(manifest["keys"])
