"""CT-RATE through the real huggingface_hub client against a mock hub on 127.0.0.1."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from graph import base_resources, build, checks, failure
from huggingface_hub import constants
from mockhub import SHA, MockHub

from zarrfeed.assets.datasets import dataset_asset
from zarrfeed.assets.hub import hub_asset
from zarrfeed.datasets import read_manifest
from zarrfeed.errors import InputError
from zarrfeed.families import Inputs
from zarrfeed.families.ct import CT, CTSettings
from zarrfeed.families.ct.tables import read_ct_rate_labels
from zarrfeed.resources import HuggingFaceResource, RawFolderResource, ZarrStoreResource
from zarrfeed.sources import CTRateHub, HubError
from zarrfeed.sources.catalog import RawCatalog
from zarrfeed.sources.hub import LISTING_FORMAT
from zarrfeed.sources.raw import hub_items, hub_origin
from zarrfeed.store import ZarrStore

REPO = "ibrahimhamamci/CT-RATE"
ct_dataset, hub_ct_catalog = dataset_asset(CT), hub_asset(CT)
TOKEN = "hf_testsecret_DO_NOT_LEAK_4242"
TRAIN = ["train_1_a_1", "train_1_a_2", "train_2_a_1"]


@pytest.fixture
def hub(tmp_path, sample_dir, monkeypatch):
    repo = tmp_path / "repo"
    shutil.copytree(sample_dir / "ct-rate", repo)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with MockHub(repo, REPO, token=TOKEN, page=2) as server:
        yield server, repo, tmp_path


def client(server, tmp_path, **kw) -> CTRateHub:
    return CTRateHub(REPO, split="train", cache_dir=tmp_path / "hf", endpoint=server.url, **kw)


def test_listing_is_paginated_pinned_and_capped(hub):
    server, repo, tmp_path = hub
    sha, volumes = client(server, tmp_path).volumes()
    assert sorted(volumes) == TRAIN and len(sha) == 40
    trees = [r for r in server.requests if "/tree/" in r["path"]]
    assert len(trees) > 1 and all(sha in r["path"] for r in trees)  # pages, at the commit
    v = volumes["train_1_a_2"]
    assert v.path == "dataset/train_fixed/train_1/train_1_a/train_1_a_2.nii.gz"
    assert v.size == (repo / v.path).stat().st_size and v.sha256 == server.sha256(v.path)

    def asked(part: str) -> int:
        return sum(part in r["path"] for r in server.requests)

    revisions = asked("/revision/")
    assert sorted(client(server, tmp_path, max_scans=2).volumes()[1]) == TRAIN[:2]
    # The commit's listing was saved: the next run resolves the revision and lists nothing.
    assert asked("/revision/") == revisions + 1 and asked("/tree/") == len(trees)


def test_two_hub_paths_with_one_key_fail_that_partition_naming_both(hub, monkeypatch):
    server, repo, tmp_path = hub
    folder = repo / "dataset/train_fixed/train_1/train_1_a"
    shutil.copy(folder / "train_1_a_2.nii.gz", folder / "train 1_a_2.nii.gz")  # same key
    # What an older zarrfeed saved for this commit (the last path of a key, nothing else) is
    # never trusted, nor is a listing cut short.
    saved = tmp_path / "hf" / "zarrfeed-listings" / REPO.replace("/", "--") / SHA
    saved.mkdir(parents=True)
    (saved / "train.json").write_text(json.dumps([{"key": "train_1_a_2", "size": 1,
        "path": f"{folder.relative_to(repo)}/train 1_a_2.nii.gz", "sha256": None}]))  # fmt: skip
    (saved / f"train.v{LISTING_FORMAT}.json").write_text('[{"key": "train_1_a_2", "pa')
    h = client(server, tmp_path)
    sha, volumes = h.volumes()
    assert sha == SHA
    assert sorted(volumes) == TRAIN  # one entry for the key, naming the other path
    twin = volumes["train_1_a_2"]
    assert {twin.path, *twin.conflict} == {
        f"dataset/train_fixed/train_1/train_1_a/{n}"
        for n in ("train_1_a_2.nii.gz", "train 1_a_2.nii.gz")
    }
    catalog = RawCatalog(ZarrStore(tmp_path / "store.zarr").backend, "ct")
    changes = catalog.update(hub_origin(h), hub_items(h, sha, volumes, {}))
    assert changes.conflicts == ["train_1_a_2"]
    inputs = Inputs(CT, ZarrStore(tmp_path / "store.zarr"), catalog, {})
    for key in ("train_1_a_1", "train_2_a_1"):
        assert inputs.item(key).location.endswith(f"{key}.nii.gz")
    with pytest.raises(InputError) as err:
        inputs.item("train_1_a_2")
    assert "train_1_a_2.nii.gz" in str(err.value) and "train 1_a_2.nii.gz" in str(err.value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the saved listing keeps it
    assert client(server, tmp_path).volumes()[1]["train_1_a_2"].conflict == twin.conflict


def test_cut_download_resumes_with_a_range_request(hub, monkeypatch):
    import huggingface_hub.constants

    # Resume restarts from the last chunk written: chunks smaller than our 200 kB volumes.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)
    server, repo, tmp_path = hub
    h = client(server, tmp_path)
    sha, volumes = h.volumes()
    path = volumes["train_2_a_1"].path
    server.cut.add(path)
    local = h.download(path, sha)
    assert local.read_bytes() == (repo / path).read_bytes()
    ranges = [r["range"] for r in server.gets(path)]
    assert ranges[0] is None and ranges[-1] and int(ranges[-1].split("=")[1].split("-")[0]) > 0


def test_refused_token_and_missing_file_say_what_to_do_without_the_token(hub, monkeypatch):
    server, _, tmp_path = hub
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_123")
    with pytest.raises(HubError, match="token in HF_TOKEN was refused") as refused:
        client(server, tmp_path).volumes()
    assert "hf_wrong_token_123" not in str(refused.value) and "settings/tokens" in str(
        refused.value
    )
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubError, match="no HF_TOKEN is set"):
        client(server, tmp_path).volumes()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    h = client(server, tmp_path)
    sha, _ = h.volumes()
    with pytest.raises(HubError, match=r"dataset/train_fixed/nope\.nii\.gz: not found"):
        h.download("dataset/train_fixed/nope.nii.gz", sha)


def test_offline_listing_and_downloads_come_from_the_cache(hub):
    server, _, tmp_path = hub
    h = client(server, tmp_path)
    sha, volumes = h.volumes()
    h.download(volumes["train_1_a_1"].path, sha)
    code = f"""
import json, sys
from zarrfeed.sources import CTRateHub, HubError
h = CTRateHub({REPO!r}, split="train", cache_dir={str(tmp_path / "hf")!r}, endpoint="http://127.0.0.1:9")
sha, vols = h.volumes()
h.download(vols["train_1_a_1"].path, sha)
try:
    h.download(vols["train_1_a_2"].path, sha)
    missing = "downloaded"
except HubError as e:
    missing = str(e)
print(json.dumps({{"sha": sha, "keys": sorted(vols), "missing": missing}}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # read by huggingface_hub at import
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sha"] == sha and got["keys"] == TRAIN and "offline" in got["missing"]


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow
def test_hub_volumes_are_ct_scans_built_by_the_ct_graph_and_never_record_the_token(hub):
    server, repo, tmp_path = hub
    hf = HuggingFaceResource(
        split="train",
        cache_dir=str(tmp_path / "hf"),
        endpoint=server.url,
        max_scans=2,
    )
    resources = {
        **base_resources(),
        "hf": hf,
        "zarr_store": ZarrStoreResource(url=str(tmp_path / "store.zarr")),
        "raw": RawFolderResource(root=str(tmp_path / "no-raw-folder")),
        "ct_settings": CTSettings(spacing_zyx_mm=[5.0, 3.0, 3.0], windows=["lung"],
                                  sparse_grid=16),
    }  # fmt: skip
    store = resources["zarr_store"].store()
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        result = dg.materialize([hub_ct_catalog], resources=resources, instance=instance)
        assert result.success
        assert instance.get_dynamic_partitions(CT.partitions) == TRAIN[:2]  # CT scans
        catalog = store.open_partition("hub/catalog", "train")
        _, rows = read_ct_rate_labels(repo)
        np.testing.assert_array_equal(catalog["labels"][...], [rows[k] for k in TRAIN[:2]])
        for key in TRAIN[:2]:  # the CT graph builds them: raw scan, HU, windows, sparse, patches
            r = build(resources, instance, "ct", key)
            assert r.success and all(checks(r).values())
        hu = store.read_array("ct/hu", TRAIN[0], "hu")
        assert hu.dtype == np.int16 and -1024 <= hu.min() < -950 and hu.max() > 200
        attrs = store.commit_record("ct/hu", TRAIN[0])["attrs"]
        item = resources["zarr_store"].catalog("ct").get(TRAIN[0])
        sha = catalog.attrs["revision_sha"]
        assert attrs["source"].startswith(f"hf://datasets/{REPO}@{sha}/")
        assert attrs["source_sha256"] == server.sha256(item.detail["path"])
        # They reach the CT dataset, labels included.
        assert dg.materialize([ct_dataset], resources=resources, instance=instance).success
        assert read_manifest(store, "ct")["keys"] == TRAIN[:2]
        labels = store.read_array("datasets/ct", "labels", "labels")
        np.testing.assert_array_equal(labels, [rows[k] for k in TRAIN[:2]])
        # A rerun downloads nothing: both partitions are reused from their fingerprints.
        before = len(server.requests)
        for key in TRAIN[:2]:
            build(resources, instance, "ct", key)
        downloads = [r for r in server.requests[before:]
                     if "/resolve/" in r["path"] and "nii" in r["path"]]  # fmt: skip
        assert not downloads
        # The hub goes away: the partition fails as retryable and nothing is committed.
        store.delete_partition("ct/hu", TRAIN[1])
        cached = tmp_path / "hf" / f"datasets--{REPO.replace('/', '--')}" / "snapshots" / sha
        hf.hub().forget(cached / resources["zarr_store"].catalog("ct").get(TRAIN[1]).detail["path"])
        offline_hf = HuggingFaceResource(
            split="train",
            cache_dir=str(tmp_path / "hf"),
            endpoint=closed_port(),
            max_scans=2,
        )
        r = build({**resources, "hf": offline_hf}, instance, "ct", TRAIN[1], raise_on_error=False)
        assert not r.success and not store.has_partition("ct/hu", TRAIN[1])
        message = failure(r)
        assert "network failure" in message or "offline" in message
        logs = json.dumps([str(e) for e in instance.all_logs(result.run_id)])
        records = json.dumps(
            [store.commit_record("hub/catalog", "train"), store.commit_record("ct/hu", TRAIN[0])]
        )
        assert TOKEN not in logs and TOKEN not in records and TOKEN not in message
    assert all(r["authorization"] == f"Bearer {TOKEN}" for r in server.requests)  # it was sent


@pytest.mark.slow
def test_hub_command_builds_n_scans_and_reports_progress(hub):
    server, _, tmp_path = hub
    cmd = [
        Path(sys.executable).with_name("zarrfeed"),
        "hub",
        "--endpoint",
        server.url,
        "--split",
        "train",
        "--max-scans",
        "1",
        "--cache-dir",
        str(tmp_path / "hf"),
        "--store",
        str(tmp_path / "store.zarr"),
        "--dagster-home",
        str(tmp_path / "home"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    # Piped, the progress display is one line per run; the table and the count follow.
    assert "] hub volume " in out.stdout and "2/2 runs succeeded" in out.stdout
    assert TOKEN not in out.stdout + out.stderr
