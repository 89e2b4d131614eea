"""Dataset versions as snapshots: a reader is never disturbed by rebuilds, deletions or
collection; superseded versions stay readable while retained; leases of dead readers lapse."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import s3server
from torch.utils.data import DataLoader

from zarrfeed.datasets import (
    Retention,
    collect,
    consolidate,
    manifest_url,
    plan_dataset,
    publish_dataset,
    read_manifest,
    snapshots,
)
from zarrfeed.errors import StoreError
from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.store import ZarrStore, provenance
from zarrfeed.store.layout import meta
from zarrfeed.transforms.sparse import occupancy_coords

ASSETS = ["ct/windows", "ct/sparse", "ct/patches"]
KEYS = [f"scan_{i}" for i in range(6)]
SHAPE, PATCH = (32, 64, 64), (8, 16, 16)


def build(store: ZarrStore, seed: int, retention: Retention | None = None) -> dict:
    """Every partition of every key written again (other values for every ``seed``), then
    the next dataset version."""
    rng = np.random.default_rng(seed)
    for key in KEYS:
        vol = rng.random(SHAPE, dtype=np.float32).astype(np.float16)
        with store.write_partition("ct/windows", key, provenance("test", None, "1")) as w:
            w.write("lung", vol)
        params = {"sparse_grid": 16, "sparse_threshold": 0.5}
        with store.write_partition("ct/sparse", key, provenance("test", None, "1", params)) as w:
            w.write("lung", occupancy_coords(vol, 0.5, 16), read="rows")
        top = [s - p + 1 for s, p in zip(SHAPE, PATCH, strict=True)]
        origins = np.stack([rng.integers(0, t, 16) for t in top], 1).astype(np.uint16)
        attrs = provenance("test", None, "1", patch_shape=list(PATCH))
        with store.write_partition("ct/patches", key, attrs) as w:
            w.write("origins", origins, read="rows")
    return publish(store, retention)


def publish(store: ZarrStore, retention: Retention | None = None) -> dict:
    """The next dataset version with its patch table, as the dataset asset writes it."""
    plan = plan_dataset(store, "ct", ASSETS)
    versions = plan.versions("ct/patches")
    table = consolidate(
        store, "ct", "ct/patches", plan.keys, ["origins"], versions, table="patches"
    )
    return publish_dataset(store, plan, {"patches": table}, retention)


def epoch(ds: CTPatchDataset, during=None) -> list[np.ndarray]:
    """One epoch's batches through a real DataLoader with two workers; ``during`` runs
    after the first batch."""
    loader = DataLoader(ds, batch_size=8, num_workers=2, shuffle=False)
    out = []
    for i, batch in enumerate(loader):
        out.append(batch["image"].numpy().copy())
        if i == 0 and during is not None:
            during()
    return out


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        yield ZarrStore(tmp_path / "s.zarr")
        return
    with s3server.seaweedfs(tmp_path / "weed") as server:
        server.make_bucket("snapshots")
        yield ZarrStore(f"s3://snapshots/{uuid.uuid4().hex[:8]}", server.storage_options())


def test_an_out_of_core_epoch_is_undisturbed_by_rebuilds_and_collection(store):
    build(store, 0)
    first = CTPatchDataset(store, cache_gb=0.0005)
    undisturbed = epoch(first)
    first.close()
    ds = CTPatchDataset(store, cache_gb=0.0005)  # a third of the windows
    assert ds.nbytes() > ds.budget_bytes
    version = ds.dataset_version

    def rebuild_everything() -> None:
        start = time.monotonic()
        for seed in (1, 2):
            build(store, seed, Retention(last=1, days=0))
        collect(store, older_than_s=0)
        for key in KEYS:  # and deletions
            store.delete_partition("ct/windows", key)
        collect(store, older_than_s=0)
        # A few seconds; a forked worker that deregistered this process's pooled S3
        # connections from their shared epoll made the first write wait out the read timeout.
        assert time.monotonic() - start < 60, "a write after forked readers stalled"

    disturbed = epoch(ds, rebuild_everything)
    assert len(disturbed) == len(undisturbed) == 12
    for got, want in zip(disturbed, undisturbed, strict=True):
        np.testing.assert_array_equal(got, want)
    assert read_manifest(store, "ct")["id"] != version
    ds.close()  # its lease gone, nothing retains its version any more
    report = collect(store, older_than_s=0)
    assert f"ct@{version}" in report.expired
    with pytest.raises(StoreError, match=f"no version {version}.*past retention"):
        CTPatchDataset(store, dataset_version=version)


def test_a_superseded_version_reopens_bit_for_bit_until_past_retention(tmp_path):
    store = ZarrStore(tmp_path / "s.zarr")
    first = build(store, 0, Retention(last=2, days=0))
    ds = CTPatchDataset(store, cache_gb=0.05)
    want = [ds[i]["image"].numpy() for i in range(len(ds))]
    ds.close()
    again = build(store, 0, Retention(last=2, days=0))  # the same values, new partition versions
    assert again["id"] != first["id"]
    assert build(store, 1, Retention(last=2, days=0))["id"] != again["id"]
    collect(store, older_than_s=0)
    with pytest.raises(StoreError, match=f"no version {first['id']}.*the last 2 versions"):
        CTPatchDataset(store, dataset_version=first["id"])
    old = CTPatchDataset(store, cache_gb=0.05, dataset_version=again["id"])
    assert old.dataset_version == again["id"] != read_manifest(store, "ct")["id"]
    assert len(old) == len(want)
    reread = [old[i]["image"].numpy() for i in range(len(old))]
    for got, expected in zip(reread, want, strict=True):
        np.testing.assert_array_equal(got, expected)  # seed 0's volumes, bit for bit


def test_an_unchanged_build_keeps_its_version_id(tmp_path):
    store = ZarrStore(tmp_path / "s.zarr")
    manifest = build(store, 0)
    assert publish(store)["id"] == manifest["id"]
    assert snapshots(store).ids("ct") == [manifest["id"]]


def test_a_build_with_the_same_data_and_another_report_keeps_the_id_and_tells_the_truth(
    tmp_path,
):
    """A key left out as incomplete, then deleted: training reads the same, so the id stays
    (no retraining on identical data), but the snapshot no longer reports the key."""
    store = ZarrStore(tmp_path / "s.zarr")
    build(store, 0)
    with store.write_partition("ct/windows", "half", provenance("test", None, "1")) as w:
        w.write("lung", np.zeros(SHAPE, np.float16))
    manifest = publish(store)
    assert manifest["incomplete"] == ["half"]
    store.delete_partition("ct/windows", "half")
    again = publish(store)
    assert again["id"] == manifest["id"] and again["incomplete"] == []
    assert read_manifest(store, "ct")["incomplete"] == []
    assert read_manifest(store, "ct", manifest["id"])["incomplete"] == []
    assert snapshots(store).ids("ct") == [manifest["id"]]


READER = """
import sys, time
from zarrfeed.families.ct.datasets import CTPatchDataset
ds = CTPatchDataset(sys.argv[1], cache_gb=0.05)
ds[0]
print(ds.dataset_version, flush=True)
time.sleep(600)
"""


def test_a_killed_readers_lease_lapses_and_the_next_collection_frees_its_version(tmp_path):
    store = ZarrStore(tmp_path / "s.zarr")
    build(store, 0, Retention(last=1, days=0))
    reader = subprocess.Popen([sys.executable, "-c", READER, store.url], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        version = reader.stdout.readline().strip()
        assert version == read_manifest(store, "ct")["id"]
        old = {k: store.commit_record("ct/windows", k)["version"] for k in KEYS}
        build(store, 1, Retention(last=1, days=0))
        report = collect(store, older_than_s=0)
        assert report.leases == 1 and report.kept[f"ct@{version}"] == "read by a live reader"
        for key, v in old.items():  # every version it reads is kept
            assert store.backend.exists(f"{store.path('ct/windows', key)}/{v}/zarr.json")
        os.kill(reader.pid, signal.SIGKILL)
        reader.wait(10)
        report = collect(store, older_than_s=0)
        assert report.leases == 0 and f"ct@{version}" in report.expired
        for key, v in old.items():
            assert not store.backend.exists(f"{store.path('ct/windows', key)}/{v}/zarr.json")
        assert store.backend.list_dir(store.backend.join(meta("leases"))) == []
    finally:
        reader.kill()


def test_a_lease_of_another_machine_holds_until_it_is_not_renewed(tmp_path, monkeypatch):
    from zarrfeed.datasets import leases

    store = ZarrStore(tmp_path / "s.zarr")
    build(store, 0, Retention(last=1, days=0))
    ds = CTPatchDataset(store, cache_gb=0.05)
    monkeypatch.setattr(leases, "machine", lambda: "elsewhere")  # as another host sees it
    build(store, 1, Retention(last=1, days=0))
    assert collect(store, older_than_s=0).kept[f"ct@{ds.dataset_version}"].startswith("read by")
    later = time.time() + leases.TTL_S + 1
    assert len(leases.live(store.backend, later)) == 0  # not renewed for TTL_S: lapsed
    ds.close()


def test_a_lease_whose_store_was_removed_is_given_up_not_written_back(store, monkeypatch, caplog):
    """A reader outliving its store (a temporary folder removed under a benchmark) must not
    make the store again when it renews: on disk that raced the removal, which then failed
    with "Directory not empty"; on either, it would hold a version that may be gone."""
    from zarrfeed.datasets import leases

    lease = leases.Lease(store.backend, "ct", "v1")
    assert lease.renew()
    store.backend.remove_tree(store.backend.root)
    assert not lease.renew()
    monkeypatch.setattr(leases, "RENEW_S", 0.05)
    renewer = leases._Renewer()
    with caplog.at_level("WARNING", "zarrfeed"):
        renewer.add(lease)
        deadline = time.monotonic() + 10
        while renewer.mine.get().leases and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not renewer.mine.get().leases, "a lease found gone is renewed no more"
    assert not store.backend.exists(lease.path)
    assert store.backend.list_dir(store.backend.root) == []
    assert f"ct version v1 ({lease.path}) was removed" in caplog.text
    lease.release()


def test_a_closed_dataset_gives_its_lease_up_once(tmp_path, monkeypatch):
    """close() spends the release the dataset's finalizer would make: a second one is another
    remote delete, and once the store's server is gone the client retries it for minutes
    (seen as a 90 s stall at the end of a session after the S3 test's server stopped)."""
    import gc

    store = ZarrStore(tmp_path / "s.zarr")
    build(store, 0)
    ds = CTPatchDataset(store, cache_gb=0.05)
    backend = type(ds.store.backend)
    removed: list[str] = []
    real = backend.remove
    monkeypatch.setattr(backend, "remove", lambda self, p: removed.append(p) or real(self, p))
    ds.close()
    ds.close()
    del ds
    gc.collect()
    assert len([p for p in removed if "/leases/" in p]) == 1, removed
    assert store.backend.list_dir(store.backend.join(meta("leases"))) == []


def test_a_model_of_a_version_names_it(tmp_path):
    """Training records the version it read: the trainer's data fingerprint is the id."""
    from zarrfeed.training.trainer import data_fingerprint

    store = ZarrStore(tmp_path / "s.zarr")
    manifest = build(store, 0)
    ds = CTPatchDataset(store, cache_gb=0.05)
    build(store, 1)
    assert data_fingerprint(ds)["dataset_version"] == manifest["id"]
    assert Path(manifest_url(store, "ct", manifest["id"])).exists()
