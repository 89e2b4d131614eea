"""Manifests and record summaries proportional to what changed: the per-asset change log of
commit intents, the incremental dataset manifest, and the loud full scan without a log."""

import json
import logging

import numpy as np
import pytest

from zarrfeed.datasets import collect, write_dataset
from zarrfeed.datasets.snapshots import id_digest
from zarrfeed.store import ZarrStore, commits, garbage, jsonio, records
from zarrfeed.store.changes import ChangeLog

ASSETS = ["ct/windows", "ct/patches"]


def commit(store, asset, key, value, ok=True):
    with store.write_partition(asset, key, {"source": f"{key}.nii.gz"}) as w:
        w.write("x", np.full((4, 5, 6), value, np.float32))
        w.checks["in_range"] = ok


@pytest.fixture
def store(tmp_path, monkeypatch):
    # The next look starts where this one was (no margin), so a test needs no waiting.
    monkeypatch.setattr(records, "MARGIN_S", 0.0)
    store = ZarrStore(tmp_path / "s.zarr")
    for asset in ASSETS:
        for i in range(6):
            commit(store, asset, f"scan_{i}", i)
    return store


def full(store, name, assets, withheld=None):
    """The dataset manifest a store without indexes or manifests gets (no position)."""
    fresh = ZarrStore(store.url)
    fresh.backend.remove_tree(fresh.backend.join(".zarrfeed", "indexes"))
    fresh.backend.remove_tree(fresh.backend.join(".zarrfeed", "manifests"))
    return without_positions(write_dataset(fresh, name, assets, withheld))


def without_positions(manifest):
    """The manifest without what differs between two stores of the same content: change-log
    positions and when its version was written (its id keeps the content digest)."""
    out = {k: v for k, v in manifest.items() if k not in ("positions", "created_unix")}
    return {**out, "id": id_digest(manifest["id"])}


def counting(store, monkeypatch):
    """The keys whose records ``store`` reads, per asset; a full listing fails the test."""
    seen = {}
    real = store.commit_records

    def records(asset, keys):
        seen.setdefault(asset, []).extend(keys)
        return real(asset, keys)

    def listing(path):
        raise AssertionError(f"listed every record under {path}")

    monkeypatch.setattr(store, "commit_records", records)
    monkeypatch.setattr(store.backend, "list_stamps", listing)
    return seen


def test_an_incremental_manifest_reads_only_what_changed_and_equals_a_full_build(
    store, monkeypatch
):
    write_dataset(store, "ct", ASSETS)
    commit(store, "ct/windows", "scan_1", 10)  # rebuilt in one asset
    for asset in ASSETS:
        commit(store, asset, "scan_2", 20)  # rebuilt in both
    store.delete_partition("ct/patches", "scan_3")  # now incomplete
    for asset in ASSETS:
        store.delete_partition(asset, "scan_4")  # gone
    commit(store, "ct/patches", "scan_5", 50, ok=False)  # failed a check
    for asset in ASSETS:
        commit(store, asset, "scan_9", 90)  # new
    with monkeypatch.context() as patched:
        reads = counting(store, patched)
        manifest = write_dataset(store, "ct", ASSETS, {"scan_0": ["two raw items"]})
    changed = ["scan_0", "scan_1", "scan_2", "scan_3", "scan_4", "scan_5", "scan_9"]
    assert reads == dict.fromkeys(ASSETS, changed)  # scan_0: withheld since the last one
    assert manifest["keys"] == ["scan_1", "scan_2", "scan_9"]
    assert manifest["incomplete"] == ["scan_3"]
    assert manifest["failed"] == {"scan_0": ["two raw items"], "scan_5": ["ct/patches:in_range"]}
    version = store.commit_record("ct/windows", "scan_1")["version"]
    entries = manifest["assets"]["ct/windows"]["partitions"]
    assert [p["version"] for p in entries if p["key"] == "scan_1"] == [version]
    assert without_positions(manifest) == full(store, "ct", ASSETS, {"scan_0": ["two raw items"]})
    reads = counting(store, monkeypatch)
    assert write_dataset(store, "ct", ASSETS)["keys"] == ["scan_0", "scan_1", "scan_2", "scan_9"]
    assert reads == {key: ["scan_0"] for key in ASSETS}  # released, nothing else changed


def test_record_summaries_follow_the_log(store, monkeypatch):
    store.record_summaries("ct/windows")
    commit(store, "ct/windows", "scan_1", 10)
    store.delete_partition("ct/windows", "scan_2")
    reads = counting(store, monkeypatch)
    summaries = store.record_summaries("ct/windows")
    assert reads == {"ct/windows": ["scan_1", "scan_2"]}
    assert "scan_2" not in summaries
    assert summaries["scan_1"]["version"] == store.commit_record("ct/windows", "scan_1")["version"]


def test_a_half_commit_is_never_listed_and_a_slow_one_is_read_once_it_lands(store, monkeypatch):
    write_dataset(store, "ct", ASSETS)
    old = store.commit_record("ct/windows", "scan_1")
    # A writer noted its intent, then crashed (or is still writing) before the record.
    new = commits.new_version()
    store.changes("ct/windows").note("scan_1", new)
    first = write_dataset(store, "ct", ASSETS)
    entry = [p for p in first["assets"]["ct/windows"]["partitions"] if p["key"] == "scan_1"]
    assert entry[0]["version"] == old["version"]
    # The record lands after that look: the pending intent is looked at again.
    store.backend.write_atomic(
        store.record_path("ct/windows", "scan_1"),
        jsonio.dumps({**old, "version": new}),
    )
    reads = counting(store, monkeypatch)
    second = write_dataset(store, "ct", ASSETS)
    assert reads == {key: ["scan_1"] for key in ASSETS}
    entry = [p for p in second["assets"]["ct/windows"]["partitions"] if p["key"] == "scan_1"]
    assert entry[0]["version"] == new


@pytest.mark.parametrize("damage", ["lost", "corrupt", "compacted"])
def test_without_a_usable_log_the_manifest_scans_in_full_and_says_so(
    store, damage, caplog, monkeypatch
):
    write_dataset(store, "ct", ASSETS)
    store.record_summaries("ct/windows")
    commit(store, "ct/windows", "scan_1", 10)
    log = ChangeLog(store.backend, "ct/windows")
    if damage == "lost":
        store.backend.remove_tree(log.folder)
    elif damage == "corrupt":
        store.backend.write_atomic(f"{log.folder}/start.json", b"{not json")
    else:  # the store's maintenance compacted the log past the manifest's position
        monkeypatch.setattr(garbage, "CHANGES_KEPT_S", -3600.0)
        collect(store)
        assert store.backend.list_dir(log.folder) == ["start.json"]
    caplog.set_level(logging.WARNING, logger="zarrfeed.store.records")
    manifest = write_dataset(store, "ct", ASSETS)
    if damage != "compacted":  # compaction is routine: a full scan, without a warning
        assert "change log" in caplog.text and "ct/windows" in caplog.text
    assert without_positions(manifest) == full(store, "ct", ASSETS)
    version = store.commit_record("ct/windows", "scan_1")["version"]
    assert store.record_summaries("ct/windows")["scan_1"]["version"] == version


def test_a_key_mixing_two_builds_of_a_stage_is_left_out_and_back_once_rebuilt(
    tmp_path, monkeypatch
):
    """A dataset build after the first reads only the keys the change logs name: a rebuilt
    HU volume must still leave out the key whose windows were built from the one before
    (they would pair arrays of two volumes), and the key comes back once its windows are
    built from the new one."""
    from zarrfeed.families.ct import CT_HU, CT_WINDOWS
    from zarrfeed.store import provenance
    from zarrfeed.store.contract import UPSTREAM

    monkeypatch.setattr(records, "MARGIN_S", 0.0)
    store = ZarrStore(tmp_path / "s.zarr")
    lineage, paths = (CT_HU, CT_WINDOWS), [CT_HU.path, CT_WINDOWS.path]

    def build(spec, key: str, fingerprint: str, built_from: str | None = None) -> None:
        attrs = provenance(f"{key}.nii.gz", None, "1", fingerprint=fingerprint)
        if built_from is not None:
            attrs[UPSTREAM] = {CT_HU.name: built_from}
        with store.write_partition(spec.path, key, attrs) as w:
            w.write("x", np.zeros((4, 4), np.int16))

    for key in ("k", "other"):
        build(CT_HU, key, "hu-1")
        build(CT_WINDOWS, key, "win-1", built_from="hu-1")
    assert write_dataset(store, "ct", paths, lineage=lineage)["keys"] == ["k", "other"]
    build(CT_HU, "k", "hu-2")  # the scan changed; its windows failed to build again
    with monkeypatch.context() as patched:
        reads = counting(store, patched)
        manifest = write_dataset(store, "ct", paths, lineage=lineage)
    assert reads == {path: ["k"] for path in paths}  # incremental: only the key that changed
    assert manifest["keys"] == ["other"]
    assert manifest["failed"] == {
        "k": ["ct_windows was built from another build of ct_hu: build it again"]
    }
    build(CT_WINDOWS, "k", "win-2", built_from="hu-2")
    assert write_dataset(store, "ct", paths, lineage=lineage)["keys"] == ["k", "other"]


def test_a_dataset_never_mixes_two_values_of_a_setting_its_readers_take_per_dataset(
    tmp_path, monkeypatch
):
    """Patch size changed to 32³ and one scan rebuilt: CTPatchDataset takes one patch shape
    for every sample, so the manifest keeps the keys built with the current value and names
    the others and the stage to build again; without the current settings the most common
    value wins.  The incremental manifest agrees with a full one at every step, reading only
    the changed keys (and one kept key's records) while the current value is the kept one."""
    from zarrfeed.families.ct import CT_HU, CT_PATCHES
    from zarrfeed.store import provenance

    monkeypatch.setattr(records, "MARGIN_S", 0.0)
    store = ZarrStore(tmp_path / "s.zarr")
    lineage, paths = (CT_HU, CT_PATCHES), [CT_HU.path, CT_PATCHES.path]
    big, small = [64, 64, 64], [32, 32, 32]

    def build(key: str, patch: list[int]) -> None:
        for spec in lineage:
            params = {"patch_zyx": patch} if spec is CT_PATCHES else {}
            attrs = provenance(f"{key}.nii.gz", None, "1", params, fingerprint=f"{key}{patch}")
            with store.write_partition(spec.path, key, attrs) as w:
                w.write("x", np.zeros((4, 4), np.int16))

    def dataset(patch: list[int] | None) -> dict:
        settings = None if patch is None else {"patch_zyx": patch}
        manifest = write_dataset(store, "ct", paths, lineage=lineage, settings=settings)
        fresh = ZarrStore(store.url)
        fresh.backend.remove_tree(fresh.backend.join(".zarrfeed", "manifests"))
        whole = write_dataset(fresh, "ct", paths, lineage=lineage, settings=settings)
        assert without_positions(manifest) == without_positions(whole)
        return manifest

    def why(patch: list[int], dataset_patch: list[int]) -> list[str]:
        return [
            f"ct_patches was built with patch_zyx={json.dumps(patch)}, which readers take per "
            f"dataset, and the dataset's is {json.dumps(dataset_patch)}: build ct_patches again"
        ]

    for key in ("a", "b", "c"):
        build(key, big)
    assert dataset(big)["keys"] == ["a", "b", "c"]
    build("a", small)  # the settings changed, one scan rebuilt
    manifest = dataset(small)
    assert manifest["keys"] == ["a"]
    assert manifest["failed"] == {"b": why(big, small), "c": why(big, small)}
    majority = dataset(None)  # no current settings: the most common value
    assert majority["keys"] == ["b", "c"] and majority["failed"] == {"a": why(small, big)}
    dataset(small)
    build("b", small)
    with monkeypatch.context() as patched:
        reads = counting(store, patched)
        manifest = write_dataset(store, "ct", paths, lineage=lineage, settings={"patch_zyx": small})
    assert reads == {path: ["b"] for path in paths}  # incremental: the current value is kept
    assert manifest["keys"] == ["a", "b"] and manifest["failed"] == {"c": why(big, small)}
    build("c", [16, 16, 16])  # another value again, while the kept one is the current one
    manifest = dataset(small)
    assert manifest["keys"] == ["a", "b"] and manifest["failed"] == {"c": why([16] * 3, small)}
    build("c", small)
    assert dataset(small)["keys"] == ["a", "b", "c"]
