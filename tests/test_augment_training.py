"""The declared augmentation (``data.augment``) in training, on the CPU (device ``cpu``): the
device tier's augmented batches equal the DataLoader path's, epoch by epoch; a resumed run
repeats an uninterrupted one; the slot pool keeps the augmentation's scratch inside its
budget; and a run from YAML augments and records what it declared."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_augment import LiveBytes
from test_device_families import BATCH as FAMILY_BATCH
from test_device_families import dataset, same
from test_device_families import feed_of as family_feed
from test_training import config
from test_training_cache import build_ct, expected
from test_training_feed import BATCH, UNIT, device_tier, feed_of, take

from zarrfeed.assets.training import dagster_config, model_asset
from zarrfeed.errors import ConfigError
from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.training.augment import Augment
from zarrfeed.training.config import TrainConfig
from zarrfeed.training.data.device import DeviceSlots, augment_scratch, pool_layout
from zarrfeed.training.data.epochs import EpochChain
from zarrfeed.training.data.sampler import ResumableSampler
from zarrfeed.training.tasks import TASK_TYPES, make_task
from zarrfeed.training.trainer import train

CPU = torch.device("cpu")
# the CT recipe with its affine firing often, and an elastic field: the grid path too
DECLARED = {"recipe": "ct", "affine": {"p": 0.5}, "elastic": {"p": 0.3, "magnitude": 2.0}}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_ct(tmp_path_factory.mktemp("augment") / "store.zarr", shape=(96, 128, 160))


def close(a: list[tuple[tuple, dict]], b: list[tuple[tuple, dict]]) -> None:
    """The same tags and keys, integer tensors equal, floating ones within float16's step
    (batched and per-sample resampling round alike to within it)."""
    same(a, b, atol=2e-3, rtol=1e-3, equal_nan=True)


def by_key(
    run: list[tuple[tuple, dict]], seed: int, size: int
) -> dict[tuple[int, int], torch.Tensor]:
    """(epoch, dataset index) -> its augmented patch, from the feed's order (its seed)."""
    chain = EpochChain(ResumableSampler(size, seed=seed), BATCH)
    found = {}
    for (tag, batch), (order_tag, indices) in zip(run, chain.batches(0, 0), strict=False):
        assert tag == order_tag
        for row, index in enumerate(indices.tolist()):
            found[tag[0], index] = batch["image"][row, 0]
    return found


def test_the_device_tier_augments_as_the_loader_workers_do_epoch_by_epoch(store):
    ds = CTPatchDataset(store, cache_gb=1, seed=3, augment=DECLARED)
    per_epoch = len(ds) // BATCH
    n = 2 * per_epoch + 2  # two whole epochs and into the third
    # one loader worker process applies apply_sample to each sample; the device tiers
    # apply the batched augmentation after their gather
    runs = {mode: take(feed_of(ds, mode, "random", workers=1 if mode == "loader" else 0), n)
            for mode in ("loader", "volumes", "slots")}  # fmt: skip
    for mode in ("volumes", "slots"):
        close(runs["loader"], runs[mode])
    patches = by_key(runs["volumes"], seed=5, size=len(ds))
    moved = [i for i in range(len(ds)) if not torch.equal(
        patches[0, i], torch.from_numpy(expected(ds, i)))]  # fmt: skip
    assert len(moved) > len(ds) // 2  # the recipe did augment
    changed = [i for i in range(len(ds)) if not torch.equal(patches[0, i], patches[1, i])]
    assert len(changed) > len(ds) // 2  # and each epoch augments anew
    # what the plan says: where it augments and why
    tier, reasons = device_tier(ds, "on", 1.0)
    assert tier == "volumes" and any("augment: recipe ct" in r and "batched on cpu" in r
                                     for r in reasons), reasons  # fmt: skip
    tier, reasons = device_tier(ds, "off")
    assert tier == "loader" and any("per sample on the host" in r for r in reasons), reasons


def test_a_user_transform_keeps_the_loader_and_runs_after_the_augmentation(store):
    seen: list[torch.Tensor] = []

    def spy(sample: dict) -> dict:
        seen.append(sample["image"].clone())
        return sample

    ds = CTPatchDataset(store, cache_gb=1, seed=3, augment=DECLARED, transform=spy)
    tier, reasons = device_tier(ds, "on", 1.0)
    assert tier == "loader" and "transform= runs per sample on the host" in reasons[0]
    assert any("per sample on the host" in r for r in reasons[1:])
    ds.set_epoch(2)
    got = ds[7]["image"]
    bare = CTPatchDataset(store, cache_gb=1, seed=3)
    bare.set_epoch(2)
    alone = Augment(DECLARED).apply_sample(bare.load(7), 3, 2, 7)["image"]
    assert torch.equal(seen[-1], alone) and torch.equal(got, alone)


@pytest.mark.parametrize("mode", ["loader", "volumes"])
def test_resume_mid_epoch_with_augmentation_is_exact(store, mode):
    ds = CTPatchDataset(store, cache_gb=1, seed=3, augment=DECLARED)
    per_epoch = len(ds) // BATCH
    whole = take(feed_of(ds, mode, "auto"), per_epoch + 4)
    resumed = take(feed_of(ds, mode, "auto"), 10, (0, 30))
    for (tag, x), (want_tag, y) in zip(resumed, whole[30:40], strict=True):
        assert tag == want_tag and all(torch.equal(x[k], y[k]) for k in x), tag
    after_epoch = take(feed_of(ds, mode, "auto"), 4, (0, per_epoch))
    for (tag, x), (want_tag, y) in zip(after_epoch, whole[per_epoch:], strict=True):
        assert tag == want_tag and all(torch.equal(x[k], y[k]) for k in x), tag


def test_the_slot_pool_keeps_the_augmentation_scratch_within_its_budget(store):
    ds = CTPatchDataset(store, cache_gb=1, seed=3, augment=DECLARED)
    plain = CTPatchDataset(store, cache_gb=1, seed=3)
    bare, without = pool_layout(ds, 0, BATCH), pool_layout(plain, 0, BATCH)
    scratch = augment_scratch(ds, BATCH)
    assert bare.augment == scratch > BATCH * 32**3 * 4  # at least a float32 working copy
    assert without.augment == 0 and bare.gather == without.gather
    budget = bare.tables + bare.staging + bare.gather + bare.augment + 16 * UNIT
    pool = DeviceSlots(ds, CPU, budget, BATCH)
    assert pool.slots == 16 and pool.layout.total <= budget
    assert "augment scratch" in pool.layout.describe()
    # one byte less: the scratch takes a slot's room, and a batch's 16 units no longer fit
    with pytest.raises(ValueError, match="a batch may need 16"):
        DeviceSlots(ds, CPU, budget - 1, BATCH)
    tier, reasons = device_tier(ds, "on", (budget - 64) / (1 << 30))  # (GiB: rounded)
    assert tier == "loader" and "augment scratch" in reasons[0]
    # a budget without the scratch holds the plain dataset's pool, not the augmented one's
    assert DeviceSlots(plain, CPU, budget - bare.augment, BATCH).slots == 16
    # what the augmentation of the pool's batches allocates stays within what was counted
    order = np.random.default_rng(0).permutation(len(ds))
    peaks = []
    for epoch in range(3):
        for start in range(0, 8 * BATCH, BATCH):
            indices = order[start : start + BATCH]
            ds.set_epoch(epoch)
            batch = pool.batch(indices)
            with LiveBytes([batch["image"], batch["item"]]) as live:
                out = ds.augment.apply(batch, ds.seed, epoch, indices)
            del out
            peaks.append(live.peak)
    assert max(peaks) <= pool.layout.augment
    assert max(peaks) > BATCH * 32**3 * 2  # it did allocate: the count is not vacuous
    assert max(pool.counts.history) <= pool.slots


def test_the_training_config_declares_the_augmentation(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("task: ct_classifier\ndata:\n  augment:\n    noise: {p: 0.2}\n")
    declared = TrainConfig.load(path).data.augment
    assert declared.recipe == "ct" and declared.noise.p == 0.2  # the task's own recipe
    assert declared.noise.std == Augment({"recipe": "ct"}).config.noise.std  # the rest kept
    assert declared.flip is not None  # the recipe's other operations
    images = TrainConfig.model_validate({"task": "defect_segmentation", "data": {"augment": {}}})
    assert images.data.augment.recipe == "image" and "mask" in images.data.augment.keys
    spike = TrainConfig.model_validate({"task": "spike_deblur", "data": {"augment": {}}})
    assert spike.data.augment.recipe == "spike" and spike.data.augment.spatial_dims == 2
    assert TrainConfig.model_validate({"task": "ct_classifier"}).data.augment is None  # off
    for bad, why in [
        ("    recipe: nope\n", r"recipe: expected one of \['ct', 'image', 'none', 'spike'\]"),
        ("    noize: {p: 0.2}\n", r"line 4: data.augment.noize: unknown key"),
        ("    noise: {q: 0.2}\n", r"data.augment.noise.q"),
    ]:
        path.write_text("task: ct_classifier\ndata:\n  augment:\n" + bad)
        with pytest.raises(ConfigError, match=why):
            TrainConfig.load(path)
    # the sparse autoencoder's batches are point sets: it declares no recipe
    with pytest.raises(ConfigError, match="declares no augmentation recipe"):
        TrainConfig.load(None, task="sparse_autoencoder", data={"augment": {}})


def test_the_spike_config_refuses_quarter_turns_of_a_crop_that_is_not_square(tmp_path):
    """A quarter turn needs a square plane: with rot90 on, the spike task's config refuses a
    crop that is not square (or axes the crop lacks) as it is read, naming the field, its
    line and the crop, rather than the first augmented batch failing mid-run."""
    path = tmp_path / "run.yaml"
    path.write_text("task: spike_deblur\ndata:\n  crop: [48, 64]\n  augment: {}\n")
    with pytest.raises(
        ConfigError,
        match=r"line 3: data.crop: .*needs a square plane, .*\(spatial shape \(48, 64\)\)",
    ):
        TrainConfig.load(path)
    for bad, why in [
        (
            {"augment": {"rot90": {"axes": [0, 2]}}},
            r"rot90: axes \(0, 2\) must be distinct spatial",
        ),
        ({"crop": [48]}, r"expected \(H, W\), got \[48\]"),
    ]:
        with pytest.raises(ConfigError, match=r"data.crop: .*" + why):
            TrainConfig.load(None, task="spike_deblur", data=bad)
    for fine in [
        {"crop": [48, 48], "augment": {}},
        {"crop": [48, 64], "augment": {"rot90": None}},
        {"crop": [48, 64]},  # no augmentation
    ]:
        assert TrainConfig.load(None, task="spike_deblur", data=fine).data.crop == fine["crop"]


def test_the_augmentation_enters_the_model_asset_s_config_and_code_version(monkeypatch):
    task = TASK_TYPES["ct_classifier"]
    run_config = dagster_config(TrainConfig.model_validate({"task": task.name}), "Run")
    given = run_config(data={"augment": {"noise": {"p": 0.2}}}).model_dump()
    assert TrainConfig.model_validate({**given, "task": task.name}).data.augment.noise.p == 0.2
    before = model_asset(task.name).code_versions_by_key
    monkeypatch.setattr(task, "defaults", {**task.defaults, "data": {"augment": {"gamma": None}}})
    assert model_asset(task.name).code_versions_by_key != before
    # a task's default augmentation is the launchpad's default, and reads back the same
    defaults = TrainConfig.model_validate({"task": task.name})
    launched = dagster_config(defaults, "Run")().model_dump()
    assert TrainConfig.model_validate({**launched, "task": task.name}).data == defaults.data


def test_a_run_from_yaml_trains_augmented_records_it_and_resumes_exactly(built, tmp_path):
    store, _ = built
    lines: list[str] = []
    path = tmp_path / "run.yaml"
    path.write_text(
        f"task: ct_classifier\nstore: {store.url}\nout: {tmp_path / 'a'}\n"
        "data:\n  augment:\n    noise: {p: 0.5}\n    affine: {p: 0.5}\n"
        "dataloader:\n  workers: 1\n"
        "train: {steps: 8, checkpoint_every: 4, log_every: 4, amp: 'off', batch_size: 2}\n"
    )
    whole = train(TrainConfig.load(path), log=lines.append)
    assert any("augment: recipe ct" in s and "per sample on the host" in s for s in lines)
    assert any("augment: recipe ct" in r for r in whole.loader)
    metrics = json.loads((tmp_path / "a" / "ct_classifier" / "metrics.json").read_text())
    assert metrics["augment"]["recipe"] == "ct" and metrics["augment"]["noise"]["p"] == 0.5
    saved = torch.load(whole.checkpoint, weights_only=True)
    assert saved["config"]["data"]["augment"]["affine"]["p"] == 0.5
    # without the augmentation the same run sees other batches
    off = config(built, tmp_path / "off", "ct_classifier", steps=8, amp="off", batch_size=2)
    assert train(off).history["loss"] != whole.history["loss"]
    # interrupted at step 4, on the device tier, then resumed: the uninterrupted curve
    cut = TrainConfig.load(path, out=str(tmp_path / "b"), train={"steps": 4},
                           dataloader={"device_cache": "on"})  # fmt: skip
    first = train(cut, log=lines.append)
    assert any("batched on cpu after each gather" in s for s in lines), lines
    np.testing.assert_allclose(first.history["loss"], whole.history["loss"][:4], rtol=1e-5)
    cut.train.steps = 8
    resumed = train(cut)
    assert resumed.resumed_from == 4
    np.testing.assert_allclose(resumed.history["loss"], whole.history["loss"], rtol=1e-5)
    # another augmentation is another run: it does not continue this checkpoint
    other = TrainConfig.load(path, out=str(tmp_path / "b"), data={"augment": {"noise": None}})
    assert train(other).resumed_from == 0


@pytest.mark.parametrize("task", ["defect_segmentation", "spike_deblur"])
def test_the_other_dense_tasks_train_with_their_own_recipe(built, tmp_path, task):
    cfg = config(built, tmp_path, task, steps=2, amp="off", batch_size=2, log_every=1)
    cfg.data.augment = TrainConfig.model_validate(
        {"task": task, "data": {"augment": {}}}
    ).data.augment
    cfg.dataloader.workers = "0"
    lines: list[str] = []
    result = train(cfg, log=lines.append)
    recipe = type(cfg.data).augment_recipe
    assert any(f"augment: recipe {recipe}" in s and "per sample" in s for s in lines), lines
    assert result.step == 2 and all(np.isfinite(result.history["loss"]))
    # its samples are augmented, each key as its role says, and stay in their dtype's range
    plain, augmented = make_task(cfg).dataset("train"), make_task(cfg).dataset("train")
    augmented.augment = Augment(cfg.data.augment)
    keys = cfg.data.augment.keys
    moved = 0
    for index in range(min(8, len(plain))):
        a, b = plain[index], augmented[index]
        assert sorted(a) == sorted(b)
        for k in keys:
            assert a[k].shape == b[k].shape, (k, index)
            moved += not torch.equal(a[k].to(b[k].dtype), b[k])
        if "mask" in keys:  # masks move with their image and keep their labels
            assert b["mask"].dtype == a["mask"].dtype
            assert set(b["mask"].unique().tolist()) <= set(a["mask"].unique().tolist()) | {0}
    assert moved > 0


# each family's recipe with every operation it takes firing often
FAMILY_AUGMENT = {
    "images": {"recipe": "image", "affine": {"p": 0.6}, "elastic": {"p": 0.3, "magnitude": 2.0}},
    # (the crops here are 48 x 64: quarter turns need a square plane, and refuse others)
    "spike": {"recipe": "spike", "flip": {"p": 0.6}, "rot90": None},
}


@pytest.mark.parametrize("family", sorted(FAMILY_AUGMENT))
def test_every_family_is_augmented_on_the_device_as_on_the_host(built, family):
    """Image patches with their defects and masks, spike clips with their frames and voxels:
    the device tier's batches, augmented after the gather, equal the host path's, each
    sample augmented as it is read, into a second epoch; a resumed feed repeats them."""
    ds = dataset(built, family)
    ds.augment = Augment(FAMILY_AUGMENT[family])
    per_epoch = len(ds) // FAMILY_BATCH
    n = per_epoch + 3
    host, device = take(family_feed(ds, False), n), take(family_feed(ds, True), n)
    close(host, device)
    plain = dataset(built, family)
    bare = take(family_feed(plain, True), n)
    assert any(not torch.equal(a[k], b[k]) for (_, a), (_, b) in zip(bare, device, strict=True)
               for k in a)  # fmt: skip  # it did augment
    if family == "images":  # the mask moved with its image: still a 0/1 mask
        assert all(set(b["mask"].unique().tolist()) <= {0, 1} for _, b in device)
    resumed = take(family_feed(ds, True), 3, (0, per_epoch - 1))
    close(resumed, device[per_epoch - 1 : per_epoch + 2])
