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
from mockhub import MockHub

from zarrfeed.assets import hub_assets
from zarrfeed.assets.partitions import hub_ct_scans
from zarrfeed.formats.discover import read_ct_rate_labels
from zarrfeed.resources import BuildOptions, HuggingFaceResource, ZarrStoreResource
from zarrfeed.sources import CTRateHub, HubError

REPO = "ibrahimhamamci/CT-RATE"
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
    assert sorted(client(server, tmp_path, max_scans=2).volumes()[1]) == TRAIN[:2]


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
def test_catalog_and_volumes_materialise_resume_and_never_record_the_token(hub):
    server, repo, tmp_path = hub
    hf = HuggingFaceResource(
        split="train",
        cache_dir=str(tmp_path / "hf"),
        endpoint=server.url,
        max_scans=2,
        download_retries=1,
    )
    resources = {
        "hf": hf,
        "zarr_store": ZarrStoreResource(url=str(tmp_path / "store.zarr")),
        "build": BuildOptions(),
    }
    store = resources["zarr_store"].store()
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        result = dg.materialize(hub_assets[:1], resources=resources, instance=instance)
        assert result.success
        assert instance.get_dynamic_partitions(hub_ct_scans.name) == TRAIN[:2]
        catalog = store.open_partition("hub/catalog", "train")
        _, rows = read_ct_rate_labels(repo)
        np.testing.assert_array_equal(catalog["labels"][...], [rows[k] for k in TRAIN[:2]])
        for key in TRAIN[:2]:
            r = dg.materialize(
                hub_assets[1:], partition_key=key, resources=resources, instance=instance
            )
            assert all(c.passed for c in r.get_asset_check_evaluations())
        image = store.open_array("hub/ctclip", TRAIN[0], "image")
        assert image.shape == (240, 480, 480) and image.dtype == np.float16
        attrs = store.commit_record("hub/ctclip", TRAIN[0])["attrs"]
        assert attrs["revision_sha"] in attrs["source"] and attrs["source_sha256"] == server.sha256(
            catalog.attrs["files"][TRAIN[0]][0]
        )
        # A rerun downloads nothing: both partitions are reused from their fingerprints.
        before = len(server.requests)
        for key in TRAIN[:2]:
            dg.materialize(
                hub_assets[1:], partition_key=key, resources=resources, instance=instance
            )
        assert not [
            r for r in server.requests[before:] if "/resolve/" in r["path"] and "nii" in r["path"]
        ]
        # The hub goes away: the new partition fails as retryable and nothing is committed.
        instance.add_dynamic_partitions(hub_ct_scans.name, ["train_2_a_1"])
        store.delete_partition("hub/ctclip", TRAIN[1])
        sha = catalog.attrs["revision_sha"]
        cached = tmp_path / "hf" / f"datasets--{REPO.replace('/', '--')}" / "snapshots" / sha
        hf.hub().forget(cached / catalog.attrs["files"][TRAIN[1]][0])  # not in the cache either
        offline_hf = HuggingFaceResource(
            split="train",
            cache_dir=str(tmp_path / "hf"),
            endpoint=closed_port(),
            max_scans=2,
            download_retries=1,
        )
        down = {**resources, "hf": offline_hf}
        r = dg.materialize(
            hub_assets[1:],
            partition_key=TRAIN[1],
            resources=down,
            instance=instance,
            raise_on_error=False,
        )
        assert not r.success and not store.has_partition("hub/ctclip", TRAIN[1])
        failure = next(e for e in r.all_events if e.is_step_failure)
        message = failure.event_specific_data.error.to_string()
        assert "network failure" in message or "offline" in message
        logs = json.dumps([str(e) for e in instance.all_logs(result.run_id)])
        records = json.dumps(
            [
                store.commit_record("hub/catalog", "train"),
                store.commit_record("hub/ctclip", TRAIN[0]),
            ]
        )
        assert TOKEN not in logs and TOKEN not in records and TOKEN not in message
    assert all(r["authorization"] == f"Bearer {TOKEN}" for r in server.requests)  # it was sent


@pytest.mark.slow
def test_hub_command_builds_n_scans_with_a_progress_bar(hub):
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
    assert "hub volumes" in out.stderr and "2/2 runs succeeded" in out.stdout  # tqdm, table
    assert TOKEN not in out.stdout + out.stderr
