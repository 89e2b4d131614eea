"""The datasets as torch Datasets: plain DataLoaders, the docs' snippets as a script,
transforms, and patch samplers."""

import functools
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from zarrfeed.datasets import collect, consolidate, write_dataset
from zarrfeed.errors import StoreError
from zarrfeed.families.ct.datasets import CTPatchDataset, SparsePointsDataset, collate_points
from zarrfeed.families.images.datasets import ImagePatchDataset
from zarrfeed.families.spike.datasets import SpikeClipDataset
from zarrfeed.store import ZarrStore, provenance
from zarrfeed.training import ForegroundPatches, collate_batch, make_loader
from zarrfeed.training.data.patches import PATCH_SAMPLERS
from zarrfeed.training.data.protocols import PatchSampling, PatchSource, WorkerSettings
from zarrfeed.training.data.workers import init_worker
from zarrfeed.transforms.sparse import occupancy_coords

TRAINING_DATA = Path(__file__).resolve().parents[1] / "docs" / "training-data.md"


def same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=k)


def test_a_plain_dataloader_batch_equals_the_fast_path(built):
    store, _ = built
    ds = CTPatchDataset(store, window="lung", cache_gb=0.25)
    picks = [3, 0, 7, 5, 1, 2, 6, 4]
    samples = ds.__getitems__(picks)
    assert len(samples) == 8 and all(isinstance(s, dict) for s in samples)
    fast = ds.collate(samples)
    assert fast["image"].data_ptr() == samples[0]["image"].data_ptr()  # handed on, not copied
    same(fast, default_collate([ds[i] for i in picks]))
    plain = next(iter(DataLoader(ds, batch_size=8, num_workers=2)))
    loader, _ = make_loader(ds, batch_size=8, workers=2, shuffle=False, log=None, context="fork")
    same(plain, next(iter(loader)))
    same(plain, default_collate([ds[i] for i in range(8)]))
    assert plain["image"].shape == (8, 1, *ds.patch_shape) and plain["labels"].shape[0] == 8
    for told in (False, True):  # workers told that the collate hands batches on whole
        settings = WorkerSettings(shared_batches=told)
        loader = DataLoader(
            ds, batch_size=8, num_workers=1, collate_fn=collate_and_say_if_shared,
            multiprocessing_context="fork",
            worker_init_fn=functools.partial(init_worker, os.getpid(), settings),
        )  # fmt: skip
        shared = [was for _, (_, was) in zip(range(3), loader, strict=False)]
        assert shared == [told] * 3  # read straight into what crosses processes, when told


def collate_and_say_if_shared(samples: list[dict]) -> tuple[dict, bool]:
    """ds.collate, and whether the batch buffer was in shared memory before it."""
    return collate_batch(samples), samples[0]["image"].is_shared()


def test_every_dataset_batches_in_a_plain_dataloader(built):
    store, _ = built
    for ds in (
        CTPatchDataset(store, window="lung", patch=False, cache_gb=0.25),
        ImagePatchDataset(store, cache_gb=0.25),
        SpikeClipDataset(store, crop=(32, 32), cache_gb=0.25),
    ):
        batch = next(iter(DataLoader(ds, batch_size=2)))
        same(batch, default_collate([ds[0], ds[1]]))
    points = SparsePointsDataset(store, window="lung", cache_gb=0.25)
    assert points.collate is collate_points
    batch = next(iter(DataLoader(points, batch_size=2, collate_fn=points.collate)))
    assert batch["counts"].tolist() == [len(points[0]["coords"]), len(points[1]["coords"])]


def python_blocks(page: Path) -> list[str]:
    """The python blocks of one page of the docs."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


@pytest.mark.slow
def test_the_docs_training_snippets_run_as_a_top_level_script(built, tmp_path):
    """No ``__main__`` guard: forkserver workers would re-run the script; auto picks fork.
    An explicit forkserver fails in one line naming the fix; under a guard auto keeps
    forkserver."""
    store, _ = built
    blocks = python_blocks(TRAINING_DATA)
    assert "make_loader(" in blocks[0] and "DataLoader(" in blocks[1]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "zarrfeed.zarr").symlink_to(Path(store.url))
    script = tmp_path / "train_snippet.py"
    script.write_text(
        "\n".join(blocks)
        + "\nfor batch in loader:\n    pass\n"  # the second block's plain DataLoader too
        + "try:\n    make_loader(ds, batch_size=8, workers=2, context='forkserver')\n"
        + "except Exception as exc:\n    print('REFUSED', exc)\n"
        + "if __name__ == '__main__':\n"
        + "    print('GUARDED', make_loader(ds, batch_size=8, workers=2, log=None)[1].context)\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "num_workers=2" in out.stdout and "context=fork\n" in out.stdout, out.stdout
    assert "start method: fork (auto: the loader is made at the top level" in out.stdout
    refused = next(line for line in out.stdout.splitlines() if line.startswith("REFUSED"))
    line = (
        script.read_text()
        .splitlines()
        .index("    make_loader(ds, batch_size=8, workers=2, context='forkserver')")
    )
    assert 'if __name__ == "__main__":' in refused and f"{script} (line {line + 1})" in refused
    assert "GUARDED forkserver" in out.stdout


def cache_digest(ds: CTPatchDataset) -> str:
    h = hashlib.sha256()
    for item in range(len(ds.keys)):
        h.update(np.ascontiguousarray(ds.array(item, ds.window)).tobytes())
    return h.hexdigest()


def test_monai_random_flip_through_transform_leaves_the_cache_alone(built):
    from monai.transforms import RandFlipd

    store, _ = built
    plain = CTPatchDataset(store, window="lung", cache_gb=0.25)
    plain.preload()
    before = cache_digest(plain)
    flip = RandFlipd(keys="image", prob=0.5, spatial_axis=2)
    ds = CTPatchDataset(store, window="lung", cache_gb=0.25, transform=flip, seed=3)
    n = 16
    got = [ds[i] for i in range(n)]
    flipped = 0
    for i, sample in enumerate(got):
        base = plain[i]["image"]
        assert type(sample["image"]) is torch.Tensor  # MONAI's MetaTensor made plain
        if torch.equal(sample["image"], base):
            continue
        torch.testing.assert_close(sample["image"], base.flip(-1), rtol=0, atol=0)
        flipped += 1
    assert 0 < flipped < n  # random: some flipped, some not
    same(ds.collate(ds.__getitems__(list(range(n)))), default_collate(got))  # batched alike
    again = CTPatchDataset(store, window="lung", cache_gb=0.25, transform=flip, seed=3)
    for i in range(n):  # the same (seed, epoch, index) flips the same samples
        same(again[i], got[i])
    again.set_epoch(1)
    assert any(not torch.equal(again[i]["image"], got[i]["image"]) for i in range(n))

    def in_place(sample: dict) -> dict:
        sample["image"].fill_(7)  # a transform that writes into what it was given
        return sample

    ds.transform = in_place
    ds.__getitems__(list(range(n)))
    assert all(float(ds[i]["image"].max()) == 7 for i in range(3))
    assert cache_digest(plain) == before  # the cache never saw a transform


def phantom(root: Path, shape=(32, 64, 64), patch=(8, 16, 16), grid=16) -> ZarrStore:
    """Two volumes of air with one bright 8x12x12 block each, their occupancy on a
    ``grid``³ grid (as ``ct_sparse`` stores it) and a stored index of 16 patches each."""
    store = ZarrStore(root)
    keys, rng = ["a", "b"], np.random.default_rng(0)
    for i, key in enumerate(keys):
        vol = np.zeros(shape, np.float16)
        z, y, x = 4 + 10 * i, 40 - 20 * i, 8 + 30 * i
        vol[z : z + 8, y : y + 12, x : x + 12] = 1
        with store.write_partition("ct/windows", key, provenance("test", None, "1")) as w:
            w.write("lung", vol)
        params = {"sparse_grid": grid, "sparse_threshold": 0.5}
        with store.write_partition("ct/sparse", key, provenance("test", None, "1", params)) as w:
            w.write("lung", occupancy_coords(vol, 0.5, grid), read="rows")
        origins = np.stack(
            [rng.integers(0, s - p + 1, 16) for s, p in zip(shape, patch, strict=True)], 1
        )
        attrs = provenance("test", None, "1", patch_shape=list(patch))
        with store.write_partition("ct/patches", key, attrs) as w:
            w.write("origins", origins.astype(np.uint16), read="rows")
    write_dataset(store, "ct", ["ct/windows", "ct/sparse", "ct/patches"])
    consolidate(store, "ct", "ct/patches", keys, ["origins"], table="patches")
    return store


@pytest.fixture(scope="module")
def phantom_store(tmp_path_factory) -> ZarrStore:
    return phantom(tmp_path_factory.mktemp("phantom") / "store.zarr")


def origins_over_epochs(ds: CTPatchDataset, epochs: int) -> np.ndarray:
    found = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        found.append(ds.patch_origins(np.arange(len(ds))))
    return np.concatenate(found)


def test_uniform_patches_cover_the_volume_within_bounds(phantom_store):
    ds = CTPatchDataset(phantom_store, cache_gb=0.05, patch_sampler="uniform")
    origins = origins_over_epochs(ds, 20)  # 640 patches
    top = np.array([32 - 8, 64 - 16, 64 - 16])
    assert (origins >= 0).all() and (origins <= top).all()
    for axis in range(3):  # every origin along each axis is reached
        assert set(origins[:, axis].tolist()) == set(range(top[axis] + 1))
    i = int(np.argmax(origins[-len(ds) :, 0]))  # a sample reads its own origin's patch
    z, y, x = origins[-len(ds) + i]
    want = phantom_store.open_array("ct/windows", ds.keys[ds.items[i]], "lung")
    np.testing.assert_array_equal(
        ds[i]["image"][0].numpy(), want[z : z + 8, y : y + 16, x : x + 16]
    )


def test_foreground_patches_find_the_foreground_far_more_often(phantom_store):
    share = {}
    for name, sampler in [
        ("uniform", "uniform"),
        ("half", ForegroundPatches(0.5)),
        ("foreground", "foreground"),
    ]:
        ds = CTPatchDataset(phantom_store, cache_gb=0.05, patch_sampler=sampler)
        hits = []
        for epoch in range(8):
            ds.set_epoch(epoch)
            batch = ds.collate(ds.__getitems__(list(range(len(ds)))))
            hits += (batch["image"].flatten(1) > 0.5).any(1).tolist()
        share[name] = np.mean(hits)
    assert share["uniform"] < 0.2 < 0.4 < share["half"] < 0.8 < share["foreground"] == 1.0, share


def test_foreground_patches_read_the_occupancy_the_manifest_lists(tmp_path):
    """Occupied cells come from the ct_sparse versions the manifest lists, as the windows
    do: a partition rebuilt after the dataset opened (other cells) changes nothing it reads,
    where the committed cells would centre patches on another build's."""
    store = phantom(tmp_path / "store.zarr")
    ds = CTPatchDataset(store, cache_gb=0.05, patch_sampler="foreground")
    before = ds.patch_origins(np.arange(len(ds)))
    params = {"sparse_grid": 16, "sparse_threshold": 0.5}
    with store.write_partition("ct/sparse", "a", provenance("test", None, "1", params)) as w:
        w.write("lung", np.zeros((1, 3), np.uint16), read="rows")
    collect(store, older_than_s=0)  # the dataset version still names the old cells
    fresh = CTPatchDataset(store, cache_gb=0.05, patch_sampler="foreground")
    np.testing.assert_array_equal(fresh.patch_origins(np.arange(len(ds))), before)
    np.testing.assert_array_equal(ds.patch_origins(np.arange(len(ds))), before)


def test_a_patch_table_of_another_build_than_the_manifest_is_refused(tmp_path):
    """A dataset build writes its manifest, then its tables: read in between, the stored
    patch origins of a rebuilt scan (or another set of keys) belong to another build."""
    store = phantom(tmp_path / "store.zarr")
    assert len(CTPatchDataset(store, cache_gb=0.05)) == 32
    attrs = provenance("test", None, "1", patch_shape=[8, 16, 16])
    with store.write_partition("ct/patches", "a", attrs) as w:  # rebuilt: other origins
        w.write("origins", np.zeros((16, 3), np.uint16), read="rows")
    write_dataset(store, "ct", ["ct/windows", "ct/sparse", "ct/patches"])  # not its table yet
    with pytest.raises(StoreError, match="written for another build of the ct dataset"):
        CTPatchDataset(store, cache_gb=0.05)
    write_dataset(store, "ct", ["ct/windows", "ct/sparse", "ct/patches"], {"b": ["in doubt"]})
    with pytest.raises(StoreError, match="written for another build of the ct dataset"):
        CTPatchDataset(store, cache_gb=0.05)  # the manifest lost a key
    write_dataset(store, "ct", ["ct/windows", "ct/sparse", "ct/patches"])
    consolidate(store, "ct", "ct/patches", ["a", "b"], ["origins"], table="patches")
    ds = CTPatchDataset(store, cache_gb=0.05)
    assert (ds.origins[:16] == 0).all() and len(ds) == 32


def test_patch_samplers_repeat_exactly_for_a_seed(phantom_store):
    for name in ("stored", "uniform", "foreground"):
        a, b, c = (
            CTPatchDataset(phantom_store, cache_gb=0.05, patch_sampler=name, seed=s)
            for s in (5, 5, 6)
        )
        index = np.arange(len(a))
        np.testing.assert_array_equal(a.patch_origins(index), b.patch_origins(index))
        if name == "stored":
            np.testing.assert_array_equal(a.patch_origins(index), a.origins.astype(np.int64))
            continue
        assert not np.array_equal(a.patch_origins(index), c.patch_origins(index))
        first = a.patch_origins(index)
        a.set_epoch(1)
        assert not np.array_equal(a.patch_origins(index), first)  # a new epoch, new patches
    with pytest.raises(ValueError, match="patch_sampler must be one of"):
        CTPatchDataset(phantom_store, cache_gb=0.05, patch_sampler="random")


class CornerPatches:
    """A sampler of a user's own, no subclass of the package's: every patch at the first voxel
    of its volume."""

    whole_volume = True

    def bind(self, dataset: PatchSource) -> None:
        self.ndim = len(dataset.patch_shape)

    def origins(self, indices: np.ndarray) -> np.ndarray:
        return np.zeros((len(indices), self.ndim), np.int64)


def test_a_dataset_takes_any_patch_sampling_and_refuses_what_is_not_one(phantom_store):
    """The named samplers and a user's own provide PatchSampling, the CT patch dataset
    provides what they read of it (PatchSource), and it reads the patches its sampler
    places; an object that does not place patches is refused when the dataset is made, by
    what it lacks, not failed on in the first batch."""
    for name in PATCH_SAMPLERS:
        ds = CTPatchDataset(phantom_store, cache_gb=0.05, patch_sampler=name)
        assert isinstance(ds.patch_sampler, PatchSampling), name
        assert isinstance(ds, PatchSource)
    ds = CTPatchDataset(phantom_store, cache_gb=0.05, patch_sampler=CornerPatches())
    assert isinstance(ds.patch_sampler, CornerPatches)
    assert (ds.patch_origins(np.arange(len(ds))) == 0).all()
    want = phantom_store.open_array("ct/windows", ds.keys[ds.items[5]], "lung")
    np.testing.assert_array_equal(ds[5]["image"][0].numpy(), want[:8, :16, :16])
    unplaced = type("NoOrigins", (), {"whole_volume": True, "bind": lambda self, dataset: None})
    with pytest.raises(TypeError, match=r"a PatchSampling \(whole_volume, bind, origins\)"):
        CTPatchDataset(phantom_store, cache_gb=0.05, patch_sampler=unplaced())


def test_torchio_random_transforms_repeat_per_seed_epoch_and_index(phantom_store):
    import torchio as tio

    noise = tio.RandomNoise(std=0.5, include=["image"])  # draws from torch's generator

    def run(seed: int, epoch: int) -> list[torch.Tensor]:
        ds = CTPatchDataset(phantom_store, cache_gb=0.05, transform=noise, seed=seed)
        ds.set_epoch(epoch)
        return [ds[i]["image"] for i in range(4)]

    torch.manual_seed(0)
    first = run(1, 0)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(first, run(1, 0), strict=True))
    assert torch.equal(torch.rand(1), after)  # the caller's generator is left as it was
    assert not any(torch.equal(a, b) for a, b in zip(first, run(1, 1), strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(first, run(2, 0), strict=True))
