"""Faults a user's raw tree and machines produce that no earlier test named: incomplete items,
broken entries, decompression bombs, dead runs, suggested fixes, colliding keys."""

from __future__ import annotations

import gzip
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import nibabel as nib
import numpy as np
import pytest
from graph import FAMILIES, build, checks, discover, failure, materialize, requested, sensor

from zarrfeed.assets.datasets import dataset_asset
from zarrfeed.cli import build_parser
from zarrfeed.commands import partitions
from zarrfeed.commands.status import family_status
from zarrfeed.datasets import read_manifest
from zarrfeed.errors import InputError
from zarrfeed.families.ct import CT, CTSettings
from zarrfeed.formats import read_nifti, write_nifti
from zarrfeed.processes import host_identity, process_alive, rebooted
from zarrfeed.resources import RawFolderResource
from zarrfeed.samples import ct_phantom
from zarrfeed.sources.raw import SourceWatch
from zarrfeed.transforms import hu

ct_dataset = dataset_asset(CT)


def test_the_suggested_hu_override_lets_an_airless_crop_into_the_dataset(dagster_env, tmp_path):
    """An HU crop of spine and muscle has no air: refused with a message suggesting a
    per-scan override; with that override the blocking ``hu_plausible`` check passes and the
    scan is in the dataset manifest."""
    _, resources, instance = dagster_env
    chest = ct_phantom((24, 64, 64), (5.0, 5.4, 5.4), ("Lung nodule",), np.random.default_rng(0))
    raw = tmp_path / "crops"
    raw.mkdir()
    write_nifti(raw / "spine_crop.nii.gz", chest[:, 44:51, 24:40], (5.0, 5.4, 5.4))
    resources = {**resources, "raw": RawFolderResource(root=str(raw))}
    assert discover(instance, resources, "ct") == ["spine_crop"]
    refused = build(resources, instance, "ct", "spine_crop", raise_on_error=False)
    message = failure(refused)
    assert "spine_crop.nii.gz" in message and "set a per-scan HU override" in message
    settings = resources["ct_settings"].model_dump()
    fixed = {
        **resources,
        "ct_settings": CTSettings(**{**settings, "hu_overrides": {"spine_crop": "hu"}}),
    }
    result = build(fixed, instance, "ct", "spine_crop")
    assert checks(result)[("ct_hu", "hu_plausible")] is True
    assert all(checks(result).values()), checks(result)
    store = fixed["zarr_store"].store()
    rescale = store.commit_record("ct/hu", "spine_crop")["attrs"]["hu_rescale"]
    assert rescale["decided_by"] == "override"
    assert materialize([ct_dataset], instance, resources=fixed).success
    assert read_manifest(store, "ct")["keys"] == ["spine_crop"]


def test_an_override_passes_without_air_but_not_against_impossible_values():
    chest = ct_phantom((24, 64, 64), (5.0, 5.4, 5.4), ("Lung nodule",), np.random.default_rng(0))
    crop = chest[:, 44:51, 24:40]
    assert not hu.hu_plausibility(crop)[0]
    passed, facts = hu.hu_plausibility(crop, overridden=True)
    assert passed and facts["judged_as"].startswith("override")
    assert not hu.hu_plausibility(chest.astype(np.float32) - 1024, overridden=True)[0]


def test_a_new_file_colliding_with_a_committed_key_leaves_the_dataset_until_resolved(
    dagster_env,
):
    raw, resources, instance = dagster_env
    discover(instance, resources, "ct")
    assert build(resources, instance, "ct", "valid_1_a_1").success
    store = resources["zarr_store"].store()
    assert materialize([ct_dataset], instance, resources=resources).success
    assert read_manifest(store, "ct")["keys"] == ["valid_1_a_1"]
    ct_discovery = sensor(resources, "ct_discovery")
    ctx = dg.build_sensor_context(instance=instance, resources=resources)
    (raw / "elsewhere").mkdir()
    original = next(raw.rglob("valid_1_a_1.nii.gz"))
    shutil.copy(original, raw / "elsewhere" / "valid_1_a_1.nii.gz")

    def dataset_requests():
        result = ct_discovery(ctx)
        if isinstance(result, dg.SkipReason):
            return []
        ctx.update_cursor(result.cursor)  # what the daemon keeps between ticks
        return [r for r in result.run_requests if r.job_name == CT.dataset_job]

    (refresh,) = dataset_requests()
    assert refresh.asset_selection == [dg.AssetKey("ct_dataset")]
    materialize([ct_dataset], instance, resources=resources, raise_on_error=False)  # empty
    manifest = read_manifest(store, "ct")
    assert manifest["keys"] == []
    assert "elsewhere/valid_1_a_1.nii.gz" in " ".join(manifest["failed"]["valid_1_a_1"])
    catalog = resources["zarr_store"].catalog("ct")
    _, entries = family_status(CT, store, catalog, CT.values(), None, {})
    (conflict,) = [e for e in entries if e.state == "conflict"]
    assert conflict.keys == ["valid_1_a_1"] and "rename one" in conflict.fix
    assert dataset_requests() == []  # nothing new: no second refresh
    (raw / "elsewhere" / "valid_1_a_1.nii.gz").unlink()
    assert len(dataset_requests()) == 1
    assert materialize([ct_dataset], instance, resources=resources).success
    assert read_manifest(store, "ct")["keys"] == ["valid_1_a_1"]


def test_a_conflict_that_comes_back_refreshes_the_manifest_again(dagster_env):
    """The same set of conflicting keys, resolved and then back: each change asks for a
    manifest refresh with a run key of its own (the daemon drops a request whose run key
    its sensor used before, and the manifest would keep the last state)."""
    raw, resources, instance = dagster_env
    discover(instance, resources, "ct")
    ct_discovery = sensor(resources, "ct_discovery")
    ctx = dg.build_sensor_context(instance=instance, resources=resources)
    (raw / "elsewhere").mkdir()
    original = next(raw.rglob("valid_1_a_1.nii.gz"))
    copy = raw / "elsewhere" / "valid_1_a_1.nii.gz"

    def refresh_key() -> str:
        result = ct_discovery(ctx)
        ctx.update_cursor(result.cursor)  # what the daemon keeps between ticks
        (request,) = [r for r in result.run_requests if r.job_name == CT.dataset_job]
        return request.run_key

    keys = []
    for _ in range(2):
        shutil.copy(original, copy)
        keys.append(refresh_key())  # a conflict
        copy.unlink()
        keys.append(refresh_key())  # resolved
    assert len(set(keys)) == 4, keys


def test_a_renamed_scan_is_served_once_under_its_new_key_and_the_old_one_removable(
    dagster_env,
):
    """A rename (same bytes) gives a new key while the old key's partitions stay committed:
    the manifest must not serve the scan twice.  The old key is withheld naming the new one
    and the command that removes it, which the warning check shows, until it is removed."""
    raw, resources, instance = dagster_env
    discover(instance, resources, "ct")
    assert build(resources, instance, "ct", "valid_1_a_1").success
    original = next(raw.rglob("valid_1_a_1.nii.gz"))
    original.rename(original.with_name("valid_7_a_1.nii.gz"))
    assert "valid_7_a_1" in discover(instance, resources, "ct")
    assert build(resources, instance, "ct", "valid_7_a_1").success
    result = materialize([ct_dataset], instance, resources=resources)
    store = resources["zarr_store"].store()
    manifest = read_manifest(store, "ct")
    assert manifest["keys"] == ["valid_7_a_1"]
    (why,) = manifest["failed"]["valid_1_a_1"]
    assert why.startswith("duplicate: its raw source is gone and valid_7_a_1 holds")
    command = why.rsplit("`", 2)[1]
    assert command == "zarrfeed partitions remove ct valid_1_a_1"
    (check,) = [c for c in result.get_asset_check_evaluations()
                if c.check_name == "all_partitions_complete"]  # fmt: skip
    assert not check.passed and check.metadata["left_out"].value == {"valid_1_a_1": [why]}
    args = build_parser().parse_args([*shlex.split(command)[1:], "--store", store.url, "--yes"])
    assert args.func is partitions.main
    catalog = resources["zarr_store"].catalog("ct")
    partitions.execute(partitions.plan(CT, args.key, store, catalog, instance), store, catalog,
                       instance)  # fmt: skip
    result = materialize([ct_dataset], instance, resources=resources)
    assert read_manifest(store, "ct")["keys"] == ["valid_7_a_1"]
    assert read_manifest(store, "ct")["failed"] == {}
    assert checks(result)[("ct_dataset", "all_partitions_complete")] is True


def test_one_file_under_two_names_is_served_once_under_the_first_name():
    """Two names of one content both still there: which one a user meant is unknown, but a
    sample served twice (across train/valid names, a leak) is never meant.  The first in
    sort order is kept, the other withheld naming it; a key with a source is kept over one
    without, whatever the order."""
    from zarrfeed.sources.catalog import RawItem
    from zarrfeed.sources.duplicates import duplicates

    def item(key: str, location: str) -> RawItem:
        return RawItem(key, "nifti", location, "raw:/r", 1, 1.0)

    here = Path(__file__)
    index = {"b": item("b", str(here)), "c": item("c", str(here.parent))}
    heads = {
        k: {"attrs": {"source_sha256": "f" * 64, "source_stamp": index[k].stamp}} for k in "bc"
    }
    heads["a"] = {"attrs": {"source_sha256": "f" * 64}}  # its source is gone
    heads["d"] = {"attrs": {"source_sha256": "e" * 64}}  # its own content
    out = duplicates("ct", heads, index)
    assert sorted(out) == ["a", "c"]
    assert out["a"] == [
        "duplicate: its raw source is gone and b holds the same raw content (sha256 "
        "ffffffffffff): remove it with `zarrfeed partitions remove ct a`"
    ]
    assert out["c"][0].startswith(f"duplicate: {here.parent} holds the same raw content")
    assert f"as b ({here}), which the dataset keeps: delete one" in out["c"][0]
    assert duplicates("ct", heads, index, skip={"b"}).keys() == {"a"}  # c kept over a


def test_a_name_without_usable_characters_keeps_its_key_when_the_raw_root_moves(
    dagster_env, tmp_path
):
    """Such a name is keyed by a digest of its path under the raw root, not of its absolute
    path: mounting the root elsewhere must not give the scan a second key."""
    raw, resources, instance = dagster_env
    first = tmp_path / "mount_a" / "scans"
    first.mkdir(parents=True)
    shutil.copy(next(raw.rglob("valid_1_a_1.nii.gz")), first / "扫描.nii.gz")
    at_first = {**resources, "raw": RawFolderResource(root=str(first))}
    (key,) = discover(instance, at_first, "ct")
    assert key.startswith("item-")
    assert build(at_first, instance, "ct", key).success
    moved = tmp_path / "mount_b" / "scans"
    moved.parent.mkdir()
    first.rename(moved)
    at_moved = {**resources, "raw": RawFolderResource(root=str(moved))}
    assert discover(instance, at_moved, "ct") == [key]
    assert build(at_moved, instance, "ct", key).success
    assert materialize([ct_dataset], instance, resources=at_moved).success
    assert read_manifest(resources["zarr_store"].store(), "ct")["keys"] == [key]


def test_a_sample_whose_stages_come_from_two_builds_stays_out_of_the_dataset(
    dagster_env, monkeypatch
):
    """A changed scan whose HU volume and windows were rebuilt but whose later stages failed
    keeps the patch index of the old volume: the manifest leaves the key out, naming the
    stage to rebuild, until every stage is built from the same HU volume again."""
    raw, resources, instance = dagster_env
    discover(instance, resources, "ct")
    key = "train_2_a_1"
    assert build(resources, instance, "ct", key).success
    store = resources["zarr_store"].store()
    old_shape = store.commit_record("ct/windows", key)["arrays"]["lung"]["shape"]
    chest = ct_phantom((24, 64, 64), (5.0, 5.4, 5.4), ("Lung nodule",), np.random.default_rng(1))
    write_nifti(next(raw.rglob(f"{key}.nii.gz")), chest, (5.0, 5.4, 5.4))
    discover(instance, resources, "ct")

    def fails(*args, **kwargs):
        raise MemoryError("the sparse stage ran out of memory")

    monkeypatch.setattr("zarrfeed.families.ct.family.window_occupancy", fails)
    assert not build(resources, instance, "ct", key, raise_on_error=False).success
    assert store.commit_record("ct/windows", key)["arrays"]["lung"]["shape"] != old_shape
    materialize([ct_dataset], instance, resources=resources, raise_on_error=False)
    manifest = read_manifest(store, "ct")
    assert key not in manifest["keys"]
    why = " ".join(manifest["failed"][key])
    assert "ct_sparse" in why and "ct_patches" in why and "ct_windows" not in why
    monkeypatch.undo()
    assert build(resources, instance, "ct", key).success
    assert materialize([ct_dataset], instance, resources=resources).success
    assert key in read_manifest(store, "ct")["keys"]


def test_a_spike_sequence_missing_a_dat_beside_a_stray_file_fails_naming_it(dagster_env):
    raw, resources, instance = dagster_env
    seq = raw / "gopro-spike/test/GOPR0384_11_00"
    (seq / "spike_packed/000003.dat").unlink()
    (seq / "spike_packed/notes.txt").write_text("not a sample")  # keeps the file count at 6
    assert "test_GOPR0384_11_00" in discover(instance, resources, "spike")
    result = build(resources, instance, "spike", "test_GOPR0384_11_00", raise_on_error=False)
    assert not result.success
    assert "spike_packed/000003.dat" in failure(result)
    store = resources["zarr_store"].store()
    assert not store.has_partition("spike/voxels", "test_GOPR0384_11_00")


def test_a_file_that_vanishes_or_changes_during_a_build_is_named(dagster_env):
    resources = dagster_env[1]
    spike, ct_family = FAMILIES["spike"], FAMILIES["ct"]
    items = resources["raw"].scan(spike)
    item = items["train_GOPR0372_07_00"]
    watch = SourceWatch(item, spike.raw.files(item))
    watch.verify()  # unchanged: nothing to say
    dat = Path(item.location) / "spike_packed/000001.dat"
    dat.write_bytes(dat.read_bytes()[::-1])
    os.utime(dat, ns=(1, 1))
    with pytest.raises(InputError, match=r"000001\.dat.*it changed during the build"):
        watch.verify()
    watch = SourceWatch(item, spike.raw.files(item))
    (Path(item.location) / "sharp/000002.png").unlink()
    with pytest.raises(InputError, match=r"000002\.png.*it vanished during the build"):
        watch.verify()
    ct = resources["raw"].scan(ct_family)["valid_1_a_1"]
    watch = SourceWatch(ct, ct_family.raw.files(ct))
    os.replace(Path(ct.location), Path(ct.location).with_suffix(".gz.old"))
    with pytest.raises(InputError, match=r"valid_1_a_1\.nii\.gz.*vanished"):
        watch.verify()


def test_broken_entries_are_reported_and_skipped_and_every_family_still_discovered(
    dagster_env, monkeypatch
):
    raw, resources, instance = dagster_env
    folder = RawFolderResource(root=str(raw))
    good = {family: sorted(folder.scan(FAMILIES[family])) for family in ("ct", "spike", "images")}
    assert all(good.values())
    ct_folder = next(raw.rglob("valid_1_a_1.nii.gz")).parent
    (raw / "loop").symlink_to(raw / "loop")  # a folder-level loop at the root
    (ct_folder / "valid_7_a_1.nii.gz").symlink_to(ct_folder / "valid_7_a_1.nii.gz")
    (raw / "gopro-spike/test/GOPR0384_11_00/spike_packed/000009.dat").symlink_to("/nonexistent")
    (raw / "inspection/test/gone.png").symlink_to(raw / "nowhere.png")
    (raw / "other-spike").mkdir()
    (raw / "other-spike/dataset.json").write_text("{not json")
    locked = raw / "locked"
    (locked / "sub").mkdir(parents=True)
    real_scandir = os.scandir

    def scandir(path):  # chmod 000 does not stop root: refuse the listing as the kernel would
        if os.fspath(path) == str(locked):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    expected_skips = {
        "ct": ["loop", "valid_7_a_1.nii.gz", "000009.dat", "gone.png", "locked"],
        "spike": ["loop", "000009.dat", "other-spike/dataset.json", "locked"],
        "images": ["loop", "gone.png", "locked"],
    }
    for family, keys in good.items():
        discovery = sensor(resources, f"{family}_discovery")
        ctx = dg.build_sensor_context(instance=instance, resources=resources)
        result = discovery(ctx)  # no error: every good item is found and requested
        assert list(requested(result.run_requests, keys)) == keys, family
        skipped = folder.scan(FAMILIES[family]).skipped
        text = " ".join(f"{p}: {why}" for p, why in skipped.items())
        for name in expected_skips[family]:
            assert name in text, (family, name, text)
        assert "Too many levels of symbolic links" in text
        catalog = resources["zarr_store"].catalog(family)
        settings = FAMILIES[family].values()
        store = resources["zarr_store"].store()
        _, entries = family_status(FAMILIES[family], store, catalog, settings, None, {})
        (unreadable,) = [e for e in entries if e.state == "unreadable"]
        assert str(raw / "loop") in unreadable.keys


def gzip_bomb(path: Path, shape: tuple[int, int, int]) -> Path:
    """A real .nii.gz bomb: an int16 header claiming ``shape`` and as many zeros as it claims,
    written as gzip members of 64 MiB of zeros each (one compressed member, repeated: the
    file truly inflates to the claim at about 1000:1)."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(np.int16)
    header.set_qform(np.eye(4), code=1)
    header.set_sform(np.eye(4), code=1)
    head = header.binaryblock + b"\0" * 4  # the extension flag; voxels start at byte 352
    member = gzip.compress(bytes(64 << 20), compresslevel=9)
    payload = int(np.prod(shape)) * 2
    with open(path, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(payload // (64 << 20)):
            f.write(member)
    return path


def test_a_gzip_bomb_beyond_a_plausible_ct_is_refused_naming_the_file_and_bound(tmp_path):
    bomb = gzip_bomb(tmp_path / "bomb.nii.gz", (1024, 1024, 2048))  # 4 GiB of int16
    assert bomb.stat().st_size < 8 << 20
    with pytest.raises(InputError) as err:
        read_nifti(bomb)
    message = str(err.value)
    assert "bomb.nii.gz" in message and "plausible ct item" in message
    assert "1024×1024×2048 int16" in message and str(6 << 30) in message  # claim and bound
    assert "ZARRFEED_MAX_CT_BYTES" in message


BOMB_UNDER_LIMIT = """
import resource, sys, psutil
from zarrfeed.formats import read_nifti
resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + (2 << 30),) * 2)
try:
    read_nifti(sys.argv[1]).to_hu()
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_gzip_bomb_under_a_memory_limit_fails_naming_the_file(tmp_path):
    """1 GiB of int16 is a plausible CT, but with its float32 HU copy it does not fit in the
    2 GiB this process may still take: an InputError names the file, not MemoryError."""
    bomb = gzip_bomb(tmp_path / "big.nii.gz", (512, 512, 2048))
    out = subprocess.run(
        [sys.executable, "-c", BOMB_UNDER_LIMIT, str(bomb)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.startswith("InputError"), out.stdout + out.stderr[-2000:]
    assert "big.nii.gz" in out.stdout and "bytes available to this process" in out.stdout
    assert "512×512×2048 int16" in out.stdout and "HU copy" in out.stdout  # the claim


def test_raising_the_plausible_bound_as_the_refusal_suggests_reads_the_file(tmp_path, monkeypatch):
    path = tmp_path / "scan.nii.gz"
    write_nifti(path, np.zeros((8, 16, 16), np.int16), (1.0, 1.0, 1.0))
    monkeypatch.setenv("ZARRFEED_MAX_CT_BYTES", "1000")
    with pytest.raises(InputError, match=r"scan\.nii\.gz.*raise ZARRFEED_MAX_CT_BYTES"):
        read_nifti(path)
    monkeypatch.setenv("ZARRFEED_MAX_CT_BYTES", "100000")
    assert read_nifti(path).shape == (8, 16, 16)


def test_a_process_is_alive_only_while_its_pid_is_not_dead_reused_or_from_another_boot():
    now = time.time()
    assert process_alive(os.getpid(), now)
    assert not process_alive(os.getpid(), now - 3600 * 24 * 365)  # a pid reused since
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid, now)
    here = host_identity()
    host, boot, namespace = here.split("/")
    assert not rebooted(here) and rebooted(f"{host}/another-boot/{namespace}")
    assert not rebooted(f"another-host/{boot}/{namespace}")  # left to that host's sensor
