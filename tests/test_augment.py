"""Batched, seeded augmentation: the batch equals its samples augmented one at a time,
each operation does what its reference (torch.flip, torch.rot90, the formulas, scipy's
Gaussian filter) does, masks move with images and keep their values, and the scratch memory
estimate covers what a call allocates."""

from __future__ import annotations

import subprocess
import sys
import weakref
from dataclasses import fields, replace

import numpy as np
import pydantic
import pytest
import torch
import yaml
from scipy import ndimage
from torch.overrides import TorchFunctionMode

from zarrfeed.training.augment import Augment, AugmentConfig
from zarrfeed.transforms.augment import (
    OPERATIONS,
    Affine,
    Blur,
    Elastic,
    Flip,
    Gamma,
    Intensity,
    Noise,
    Pipeline,
    Rot90,
    params,
    spatial,
)
from zarrfeed.transforms.augment.params import ROT90, mix32, rot90_matrices, stream_key, uniforms

KEYS = {"image": "image", "mask": "mask"}
SHAPES = {2: (12, 12), 3: (6, 8, 8)}
HALF = {  # every operation at p = 0.5, on axes that exist in the batch
    "flip": lambda d: Flip(p=0.5, axes=tuple(range(d))),
    "rot90": lambda d: Rot90(p=0.5, axes=(d - 2, d - 1)),
    "affine": lambda d: Affine(p=0.5, rotate=20.0, scale=(0.8, 1.2), shear=0.1, translate=2.0),
    "elastic": lambda d: Elastic(p=0.5, magnitude=2.0, grid=3),
    "intensity": lambda d: Intensity(p=0.5),
    "gamma": lambda d: Gamma(p=0.5),
    "noise": lambda d: Noise(p=0.5, std=(0.01, 0.1)),
    "blur": lambda d: Blur(p=0.5, sigma=(0.5, 1.2)),
}

CT_RECIPE = AugmentConfig(recipe="ct")  # a family's recipe, through the registry


def batch(d: int, n: int = 6, channels: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, channels, *SHAPES[d])
    mask = (torch.rand((n, 1, *SHAPES[d]), generator=g) > 0.6).to(torch.uint8)
    return {"image": torch.rand(shape, generator=g), "mask": mask, "item": torch.arange(n)}


def one_at_a_time(p: Pipeline, b: dict, seed: int, epoch: int, indices: list[int]) -> dict:
    parts = [
        p.apply({k: v[i : i + 1] for k, v in b.items()}, seed, epoch, [j])
        for i, j in enumerate(indices)
    ]
    return {k: torch.cat([part[k] for part in parts]) for k in b}


def assert_same_batch(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


# --- the counters ----------------------------------------------------------------------


def test_the_hash_gives_the_same_bits_for_ints_and_tensors():
    values = [0, 1, 12345, 0xFFFFFFFF, 0x80000000]
    tensor = mix32(torch.tensor(values, dtype=torch.int64))
    assert tensor.tolist() == [mix32(v) for v in values]
    assert all(0 <= v <= 0xFFFFFFFF for v in tensor.tolist())


def test_parameters_depend_on_seed_epoch_index_only():
    key = stream_key(7, 2, 1)
    whole = uniforms(key, torch.arange(10, 20), 4)
    alone = uniforms(key, torch.tensor([13, 10]), 4)  # another batch, another order
    assert torch.equal(alone, whole[[3, 0]])
    assert not torch.equal(uniforms(stream_key(7, 3, 1), torch.arange(10, 20), 4), whole)
    assert not torch.equal(uniforms(stream_key(8, 2, 1), torch.arange(10, 20), 4), whole)
    assert not torch.equal(uniforms(key, torch.arange(11, 21), 4), whole)
    assert len(set(whole.flatten().tolist())) == whole.numel()  # no repeats across counters
    assert whole.min() >= 0 and whole.max() < 1
    # roughly uniform: 4,000 draws, each decile within a few standard deviations
    many = uniforms(key, torch.arange(1000), 4).flatten()
    counts = torch.histc(many.float(), bins=10, min=0, max=1)
    assert ((counts - 400).abs() < 80).all(), counts


def test_different_epochs_and_indices_augment_differently():
    p = Pipeline(keys=KEYS, **{name: make(3) for name, make in HALF.items()})
    b = batch(3)
    first = p.apply(b, 0, 0, range(6))
    assert not torch.equal(first["image"], p.apply(b, 0, 1, range(6))["image"])
    assert not torch.equal(first["image"], p.apply(b, 0, 0, range(6, 12))["image"])
    assert not torch.equal(first["image"], p.apply(b, 1, 0, range(6))["image"])
    assert_same_batch(first, p.apply(b, 0, 0, range(6)), atol=0)  # and it repeats exactly


def test_grouping_does_not_change_a_sample():
    p = Pipeline(keys=KEYS, **{name: make(3) for name, make in HALF.items()})
    b = batch(3, n=8)
    whole = p.apply(b, 5, 3, range(40, 48))
    halves = [p.apply({k: v[s] for k, v in b.items()}, 5, 3, list(range(40, 48))[s])
              for s in (slice(0, 3), slice(3, 8))]  # fmt: skip
    assert_same_batch(whole, {k: torch.cat([h[k] for h in halves]) for k in b})


# --- batched == per sample -------------------------------------------------------------


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("name", list(HALF))
def test_each_operation_batched_equals_per_sample(name, d):
    p = Pipeline(keys=KEYS, **{name: HALF[name](d)})
    b = batch(d)
    indices = [3, 17, 4, 99, 0, 1000]
    assert_same_batch(p.apply(b, 11, 2, indices), one_at_a_time(p, b, 11, 2, indices))


@pytest.mark.parametrize("d", [2, 3])
def test_the_composed_pipeline_batched_equals_per_sample(d):
    p = Pipeline(keys=KEYS, **{name: make(d) for name, make in HALF.items()})
    b = batch(d, n=8)
    indices = list(range(100, 108))
    out = p.apply(b, 1, 4, indices)
    assert_same_batch(out, one_at_a_time(p, b, 1, 4, indices))
    assert not torch.equal(out["image"], b["image"])
    assert torch.equal(out["item"], b["item"])  # keys not declared pass through


@pytest.mark.parametrize("d", [2, 3])
def test_identity_when_every_probability_is_zero(d):
    p = Pipeline(keys=KEYS, **{name: replace(make(d), p=0.0) for name, make in HALF.items()})
    b = batch(d)
    b16 = {**b, "image": b["image"].to(torch.bfloat16)}
    for given in (b, b16):
        out = p.apply(given, 0, 0, range(6))
        for k in given:
            assert out[k].dtype == given[k].dtype and torch.equal(out[k], given[k]), k


# --- each operation against its reference ----------------------------------------------


@pytest.mark.parametrize("axes", [(0,), (1,), (2,), (0, 2)])
def test_a_certain_flip_is_torch_flip_and_the_mask_agrees(axes):
    b = batch(3)
    b["image"] = torch.cat([b["mask"].float(), b["image"]], dim=1)  # channel 0: the mask
    out = Pipeline(keys=KEYS, flip=Flip(p=1.0, axes=axes)).apply(b, 0, 0, range(6))
    dims = [a + 2 for a in axes]
    assert torch.equal(out["image"], b["image"].flip(dims))
    assert torch.equal(out["mask"], b["mask"].flip(dims))
    assert torch.equal(out["image"][:, :1], out["mask"].float())  # voxel by voxel


def turns(p: Pipeline, indices, shape) -> list[int]:
    m, _ = rot90_matrices(p.rot90, stream_key(0, 0, ROT90), torch.tensor(indices), shape)
    a, b = p.rot90.axes
    return [{(1, 0): 0, (0, 1): 1, (-1, 0): 2, (0, -1): 3}[(int(c), int(s))]
            for c, s in zip(m[:, a, a], m[:, a, b], strict=True)]  # fmt: skip


@pytest.mark.parametrize("d", [2, 3])
def test_a_quarter_turn_is_torch_rot90_and_the_mask_turns_with_it(d):
    p = Pipeline(keys=KEYS, rot90=Rot90(p=1.0, axes=(d - 2, d - 1)))
    b = batch(d, n=12)
    out = p.apply(b, 0, 0, range(12))
    ks = turns(p, range(12), SHAPES[d])
    assert set(ks) == {1, 2, 3}
    plane = (d, d + 1)
    for i, k in enumerate(ks):
        assert torch.equal(out["image"][i], b["image"][i].rot90(k, [a - 1 for a in plane]))
        assert torch.equal(out["mask"][i], b["mask"][i].rot90(k, [a - 1 for a in plane]))


def test_the_grid_of_a_quarter_turn_and_of_a_shift_resample_exactly():
    """The matrix -> normalised grid conversion (axis order, half sizes) on a volume whose
    axes all differ: a 90° rotation in its square plane equals torch.rot90, and a shift of
    one voxel reads the next voxel."""
    x = torch.rand(1, 1, 5, 7, 7, dtype=torch.float32)
    quarter = torch.eye(3, dtype=torch.float64)[None].clone()
    quarter[0, 1:, 1:] = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    grid = spatial.sampling_grid(quarter, torch.zeros(1, 3, dtype=torch.float64), (5, 7, 7),
                                 torch.device("cpu"))  # fmt: skip
    torch.testing.assert_close(spatial.warp(x, grid, False, "zeros"), x.rot90(1, [3, 4]))
    shift = torch.tensor([[1.0, 0.0, -2.0]], dtype=torch.float64)
    grid = spatial.sampling_grid(torch.eye(3, dtype=torch.float64)[None], shift, (5, 7, 7),
                                 torch.device("cpu"))  # fmt: skip
    moved = spatial.warp(x, grid, False, "zeros")
    torch.testing.assert_close(moved[:, :, :4, :, 2:], x[:, :, 1:, :, :5])
    torch.testing.assert_close(moved[:, :, 4], torch.zeros_like(moved[:, :, 4]))
    torch.testing.assert_close(moved[..., :2], torch.zeros_like(moved[..., :2]))


@pytest.mark.parametrize("d", [2, 3])
def test_an_affine_without_rotation_scale_or_shift_is_the_identity(d):
    b = batch(d)
    still = Affine(p=1.0, rotate=0.0, scale=(1.0, 1.0), shear=0.0, translate=0.0)
    out = Pipeline(keys=KEYS, affine=still).apply(b, 0, 0, range(6))
    torch.testing.assert_close(out["image"], b["image"], atol=1e-5, rtol=0)
    assert torch.equal(out["mask"], b["mask"])
    # folded with a flip, it is the flip
    flipped = Pipeline(keys=KEYS, flip=Flip(p=1.0, axes=(0,)), affine=still)
    out = flipped.apply(b, 0, 0, range(6))
    torch.testing.assert_close(out["image"], b["image"].flip(2), atol=1e-5, rtol=0)
    assert torch.equal(out["mask"], b["mask"].flip(2))
    quiet = Pipeline(keys=KEYS, elastic=Elastic(p=1.0, magnitude=0.0))
    torch.testing.assert_close(quiet.apply(b, 0, 0, range(6))["image"], b["image"], atol=1e-5,
                               rtol=0)  # fmt: skip


@pytest.mark.parametrize("d", [2, 3])
def test_masks_keep_their_labels_under_every_spatial_operation(d):
    b = batch(d)
    labels = torch.tensor([0, 3, 7, 255], dtype=torch.int64)
    b["mask"] = labels[torch.randint(0, 4, b["mask"].shape, generator=torch.Generator().
                                     manual_seed(1))]  # fmt: skip
    p = Pipeline(keys=KEYS, **{n: HALF[n](d) for n in ("flip", "rot90", "affine", "elastic")},
                 padding="zeros")  # fmt: skip
    out = p.apply(b, 0, 0, range(6))
    assert out["mask"].dtype == torch.int64
    assert set(out["mask"].unique().tolist()) <= set(labels.tolist())
    assert not torch.equal(out["mask"], b["mask"])
    binary = p.apply({**b, "mask": b["mask"] > 5}, 0, 0, range(6))["mask"]
    assert binary.dtype == torch.bool and torch.equal(binary, out["mask"] > 5)


def test_intensity_gamma_and_blur_follow_their_formulas():
    b = batch(3)
    x = b["image"]
    out = Pipeline(intensity=Intensity(p=1.0, scale=(2.0, 2.0), shift=(0.5, 0.5))).apply(
        b, 0, 0, range(6)
    )
    torch.testing.assert_close(out["image"], x * 2 + 0.5)
    out = Pipeline(gamma=Gamma(p=1.0, range=(2.0, 2.0))).apply(b, 0, 0, range(6))
    lo = x.amin(dim=(1, 2, 3, 4), keepdim=True)
    spread = x.amax(dim=(1, 2, 3, 4), keepdim=True) - lo
    torch.testing.assert_close(out["image"], ((x - lo) / (spread + 1e-7)) ** 2 * spread + lo)
    out = Pipeline(blur=Blur(p=1.0, sigma=(1.0, 1.0))).apply(b, 0, 0, range(6))
    want = ndimage.gaussian_filter(x.numpy(), sigma=(0, 0, 1, 1, 1), mode="nearest", truncate=3)
    np.testing.assert_allclose(out["image"].numpy(), want, atol=1e-5)
    assert torch.equal(out["mask"], b["mask"])  # intensity operations leave masks alone


def test_noise_is_gaussian_with_the_drawn_std_and_differs_between_samples():
    b = {"image": torch.zeros(4, 1, 32, 32, 32)}
    out = Pipeline(noise=Noise(p=1.0, std=(0.1, 0.1))).apply(b, 0, 0, range(4))["image"]
    assert abs(out.mean().item()) < 2e-3 and abs(out.std().item() - 0.1) < 2e-3
    assert (out.abs() < 0.6).all() and (out.abs() > 0.35).any()  # tails, not clipped near 3σ
    assert not torch.equal(out[0], out[1])
    frac = (out.abs() < 0.1).float().mean().item()
    assert abs(frac - 0.6827) < 0.01  # the share within one std of a normal


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_images_are_computed_in_float32(dtype):
    p = Pipeline(keys=KEYS, **{name: make(3) for name, make in HALF.items()})
    b = batch(3)
    low = {**b, "image": b["image"].to(dtype)}
    out = p.apply(low, 0, 0, range(6))
    assert out["image"].dtype == dtype and out["mask"].dtype == torch.uint8
    reference = p.apply({**b, "image": low["image"].float()}, 0, 0, range(6))
    torch.testing.assert_close(out["image"], reference["image"].to(dtype))
    assert torch.equal(out["mask"], reference["mask"])
    assert_same_batch(out, one_at_a_time(p, low, 0, 0, list(range(6))), atol=1e-2)


def test_integer_images_come_back_float32_and_targets_get_no_intensity():
    b = batch(2)
    b["image"] = (b["image"] * 255).to(torch.uint8)
    b["sharp"] = b["image"].float() / 255
    keys = {"image": "image", "sharp": "target", "mask": "mask"}
    flip = Pipeline(keys=keys, flip=Flip(p=1.0, axes=(0,)))
    out = flip.apply(b, 0, 0, range(6))
    assert out["image"].dtype == torch.float32
    assert torch.equal(out["image"], b["image"].flip(2).float())
    shifted = Pipeline(keys=keys, intensity=Intensity(p=1.0, scale=(1.0, 1.0), shift=(1.0, 1.0)))
    out = shifted.apply(b, 0, 0, range(6))
    assert torch.equal(out["sharp"], b["sharp"]) and torch.equal(out["mask"], b["mask"])
    assert torch.equal(out["image"], b["image"].float() + 1)


def test_spike_clips_move_in_their_last_two_axes_alike():
    g = torch.Generator().manual_seed(2)
    clip = {
        "blur": torch.randint(0, 256, (4, 3, 3, 16, 16), generator=g, dtype=torch.uint8),
        "voxels": torch.randint(0, 9, (4, 3, 5, 16, 16), generator=g, dtype=torch.uint8),
    }
    clip["sharp"] = clip["blur"].clone()
    spike = Augment({"recipe": "spike"})
    assert spike.pipeline.spatial_dims == 2 and spike.config.keys["voxels"] == "target"
    out = spike.apply(clip, 0, 0, range(4))
    assert_same_batch(out, one_at_a_time(spike.pipeline, clip, 0, 0, list(range(4))))
    for k in clip:
        assert out[k].shape == clip[k].shape and out[k].dtype == torch.float32
    assert torch.equal(out["sharp"], out["blur"])  # target and input moved alike
    flip = Pipeline(keys={"voxels": "target"}, flip=Flip(p=1.0, axes=(1,)), spatial_dims=2)
    assert torch.equal(flip.apply(clip, 0, 0, range(4))["voxels"], clip["voxels"].flip(4).float())
    estimate = spike.scratch_bytes({k: v.shape for k, v in clip.items()},
                                   {k: v.dtype for k, v in clip.items()})  # fmt: skip
    measured = measured_scratch(spike.pipeline, clip, 0)
    assert measured <= estimate <= 1.1 * measured + (16 << 10)


def test_bad_batches_are_refused_with_what_was_expected():
    p = Pipeline(keys=KEYS, rot90=Rot90(p=0.5, axes=(0, 1)))
    b = batch(2)
    with pytest.raises(KeyError, match="has no \\['mask'\\]"):
        p.apply({"image": b["image"]}, 0, 0, range(6))
    with pytest.raises(ValueError, match="expected 5 samples"):
        p.apply(b, 0, 0, range(5))
    with pytest.raises(ValueError, match="square plane"):
        p.apply({k: v[..., :10] if k != "item" else v for k, v in b.items()}, 0, 0, range(6))
    with pytest.raises(ValueError, match="axes"):
        Pipeline(flip=Flip(axes=(0, 3))).apply(b, 0, 0, range(6))
    with pytest.raises(ValueError, match="p must be in"):
        Flip(p=1.5)
    with pytest.raises(ValueError, match="roles"):
        Pipeline(keys={"image": "picture"})


# --- the declaration -------------------------------------------------------------------

TRAINING_YAML = """
data:
  window: lung
  augment:
    recipe: ct
    noise: {p: 0.2}
    elastic: {p: 0.1, magnitude: 3.0}
    gamma: null
"""


def test_the_training_yaml_declares_the_augmentation():
    config = AugmentConfig.model_validate(yaml.safe_load(TRAINING_YAML)["data"]["augment"])
    assert config.noise == Noise(p=0.2, std=(0.0, 0.03))  # the recipe's std, p as given
    assert config.elastic == Elastic(p=0.1, magnitude=3.0, grid=5)
    assert config.gamma is None and config.flip == Flip(p=0.5, axes=(0, 1, 2))
    assert config.keys == {"image": "image"}
    assert "noise(p=0.2)" in config.describe()
    out = Augment(config).apply({"image": torch.rand(2, 1, 8, 8, 8)}, 0, 0, [4, 5])
    assert out["image"].shape == (2, 1, 8, 8, 8)
    image = AugmentConfig(recipe="image")
    assert image.keys == {"image": "image", "mask": "mask"} and image.blur is not None
    assert Augment({"recipe": "none"}).pipeline == Pipeline()
    for bad in ({"nois": {}}, {"noise": {"p": 2}}, {"flip": {"axis": [0]}}, {"recipe": "mri"}):
        with pytest.raises(ValueError):
            AugmentConfig.model_validate(bad)


def test_the_config_the_engine_and_the_streams_hold_the_declared_operations():
    """``ops.Operations`` lists the operations once: the training config has a field for
    each and no other (the engine would drop it), every test here covers each, and each
    draws from a parameter stream of its own."""
    settings = {"recipe", "keys", "padding", "spatial_dims"}
    assert set(AugmentConfig.model_fields) - settings == set(OPERATIONS)
    assert {f.name for f in fields(Pipeline)} - settings == set(OPERATIONS)
    assert list(HALF) == list(OPERATIONS)
    streams = [getattr(params, name.upper()) for name in OPERATIONS]
    assert len(set(streams)) == len(OPERATIONS)


def test_the_config_reads_back_its_yaml_and_its_errors_name_the_field():
    """The config's operation fields come from ``ops.Operations``, in the YAML shape a run
    writes: dumped (as ``to_yaml`` does) it reads back equal, in the declared order, and a
    bad value, an unknown operation or an unknown field of one is refused where it is."""
    config = AugmentConfig(recipe="image", noise={"p": 0.1}, blur=None)
    dumped = config.model_dump(mode="json")
    assert list(dumped) == ["recipe", "keys", *OPERATIONS, "padding", "spatial_dims"]
    assert dumped["noise"] == {"p": 0.1, "std": [0.0, 0.03]} and dumped["blur"] is None
    assert AugmentConfig.model_validate(yaml.safe_load(yaml.safe_dump(dumped))) == config
    for bad, where in [
        ({"noise": {"p": 2}}, ("noise",)),
        ({"nois": {}}, ("nois",)),
        ({"flip": {"axis": [0]}}, ("flip", "axis")),
    ]:
        with pytest.raises(pydantic.ValidationError) as caught:
            AugmentConfig.model_validate(bad)
        assert [e["loc"] for e in caught.value.errors()] == [where]


def test_a_sample_augmented_on_its_own_is_its_row_of_the_batch():
    """What a DataLoader worker does (one sample, no batch axis, on the host) gives the
    batch the device path cuts, once collated."""
    augment = Augment(AugmentConfig(recipe="image", elastic={"p": 0.5}))
    b = batch(2, n=5, channels=3)
    indices = [8, 3, 5, 1, 13]
    samples = [
        augment.apply_sample({"image": b["image"][i], "mask": b["mask"][i], "item": i}, 2, 7, j)
        for i, j in enumerate(indices)
    ]
    collated = torch.utils.data.default_collate(samples)
    assert_same_batch(
        {k: collated[k] for k in ("image", "mask")},
        {k: v for k, v in augment.apply(b, 2, 7, indices).items() if k != "item"},
    )
    assert collated["item"].tolist() == list(range(5))


def test_reading_the_declaration_imports_no_torch():
    """The training config (which the CLI's parser reads) can hold ``data.augment``."""
    code = (
        "import sys\n"
        "from zarrfeed.training.augment import AugmentConfig\n"
        "AugmentConfig.model_validate({'recipe': 'image', 'noise': {'p': 0.1}}).describe()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_default_recipes_run_batched_equal_to_per_sample():
    ct = Augment(AugmentConfig(recipe="ct"))
    b = {"image": torch.rand(4, 1, 8, 16, 16).half()}
    assert_same_batch(ct.apply(b, 0, 1, range(4)), one_at_a_time(ct.pipeline, b, 0, 1,
                      list(range(4))), atol=1e-2)  # fmt: skip
    image = Augment(AugmentConfig(recipe="image"))
    b = batch(2, n=4, channels=3)
    assert_same_batch(image.apply(b, 0, 1, range(4)),
                      one_at_a_time(image.pipeline, b, 0, 1, list(range(4))))  # fmt: skip


# --- scratch memory --------------------------------------------------------------------


class LiveBytes(TorchFunctionMode):
    """The peak bytes of tensor storages created under it and still referenced (inputs
    excluded): every torch call's outputs are counted until their last tensor dies."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in inputs}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _dead(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= self.sizes.pop(ptr)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.known or ptr == 0:
                    continue
                if ptr not in self.refs:
                    self.refs[ptr], self.sizes[ptr] = 0, t.untyped_storage().nbytes()
                    self.live += self.sizes[ptr]
                self.refs[ptr] += 1
                weakref.finalize(t, self._dead, ptr)
        self.peak = max(self.peak, self.live)
        return out


def measured_scratch(p: Pipeline, b: dict, epoch: int) -> int:
    with LiveBytes([v for v in b.values() if isinstance(v, torch.Tensor)]) as mode:
        out = p.apply(b, 0, epoch, range(len(next(iter(b.values())))))
    del out
    return mode.peak


CASES = {
    "every operation, 3-D": (
        3,
        {n: replace(m(3), p=1.0) for n, m in HALF.items()},
        torch.float32,
    ),
    "every operation, 2-D, bfloat16": (
        2,
        {n: replace(m(2), p=1.0) for n, m in HALF.items()},
        torch.bfloat16,
    ),
    "the CT recipe, float16": (3, {n: getattr(CT_RECIPE, n) for n in HALF}, torch.float16),
    "flips and turns only (gather)": (
        3,
        {"flip": Flip(p=1.0), "rot90": Rot90(p=1.0)},
        torch.float32,
    ),
    "intensity only": (
        2,
        {"intensity": Intensity(p=1.0), "noise": Noise(p=1.0)},
        torch.float16,
    ),
    "labels as int64": (3, {"affine": Affine(p=1.0), "gamma": Gamma(p=1.0)}, torch.int64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_scratch_bytes_covers_what_a_call_allocates(case):
    d, ops, dtype = CASES[case]
    p = Pipeline(keys=KEYS, **ops)
    shape = {2: (4, 3, 48, 48), 3: (4, 1, 16, 24, 24)}[d]
    b = {"image": torch.rand(shape).to(dtype),
         "mask": (torch.rand((shape[0], 1, *shape[2:])) > 0.5).to(torch.uint8)}  # fmt: skip
    if dtype == torch.int64:  # the image in uint8, the labels in int64
        b = {"image": (b["image"] * 255).to(torch.uint8), "mask": b["mask"].long()}
    estimate = p.scratch_bytes({k: v.shape for k, v in b.items()},
                               {k: v.dtype for k, v in b.items()})  # fmt: skip
    # different epochs fire different operations (where p < 1): the estimate covers each
    measured = [measured_scratch(p, b, epoch) for epoch in range(3)]
    assert min(measured) > b["image"].numel()  # the count sees the intermediates
    assert max(measured) <= estimate <= 1.1 * max(measured) + (16 << 10), (case, measured, estimate)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_batch_equals_the_host_samples():
    p = Augment(AugmentConfig(recipe="ct", elastic={"p": 0.5}, blur={"p": 0.5})).pipeline
    b = {"image": torch.rand(8, 1, 16, 32, 32)}
    on_device = p.apply({"image": b["image"].cuda()}, 3, 2, range(8))
    assert_same_batch({"image": on_device["image"].cpu()},
                      one_at_a_time(p, b, 3, 2, list(range(8))), atol=1e-4)  # fmt: skip
