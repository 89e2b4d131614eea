from dataclasses import replace

import numpy as np
import pydicom
import pytest
import torch
from pydicom.pixels import apply_windowing

from zarrfeed.transforms import ct
from zarrfeed.transforms.stats import finite_range, int16_percentiles


def test_presets_are_the_radiopaedia_values():
    assert {k: (w.width, w.level) for k, w in ct.WINDOWS.items()} == {
        "lung": (1500, -600), "mediastinum": (350, 50), "abdomen": (400, 50),
        "liver": (150, 30), "bone": (1800, 400), "brain": (80, 40), "ct-clip": (2000, 0),
    }  # fmt: skip
    assert ct.get_window("400/40") == ct.Window(400, 40)
    with pytest.raises(ValueError, match="unknown window"):
        ct.get_window("lungs")


@pytest.mark.parametrize("name", sorted(ct.WINDOWS))
def test_window_matches_formula_and_pydicom(name):
    w = ct.WINDOWS[name]
    hu = np.random.default_rng(0).integers(-1100, 3000, size=(7, 33, 41)).astype(np.int16)
    got = ct.apply_window(hu, name, "float32")
    formula = np.clip((hu.astype(np.float64) - (w.level - w.width / 2)) / w.width, 0, 1)
    np.testing.assert_allclose(got, formula, atol=1e-6)
    ds = pydicom.Dataset()
    ds.PhotometricInterpretation, ds.BitsStored, ds.PixelRepresentation = "MONOCHROME2", 16, 1
    ds.WindowCenter, ds.WindowWidth, ds.VOILUTFunction = w.level, w.width, "LINEAR_EXACT"
    ref = apply_windowing(hu.astype(np.float64), ds)  # maps onto [-32768, 32767]
    np.testing.assert_allclose(got, (ref + 32768) / 65535, atol=1e-5)
    f16 = ct.apply_window(hu, name)
    assert f16.dtype == np.float16 and np.abs(f16.astype(np.float64) - formula).max() < 1e-3
    u8 = ct.apply_window(hu, name, "uint8")
    diff = u8.astype(np.int64) - np.rint(formula * 255)
    assert u8.dtype == np.uint8 and np.abs(diff).max() <= 1  # float32 vs float64 at .5 ties
    assert np.mean(diff != 0) < 0.01


def test_resample_follows_ct_clip_size_rule_and_is_exact_on_a_ramp():
    z = np.arange(30, dtype=np.float32)
    vol = np.broadcast_to(z[:, None, None] * 10, (30, 8, 9)).copy()
    out = ct.resample(vol, (3.0, 1.0, 1.0), (1.5, 1.0, 1.0))
    assert (
        out.shape == (60, 8, 9) == ct.resampled_shape(vol.shape, (3.0, 1.0, 1.0), (1.5, 1.0, 1.0))
    )
    # align_corners=False: output sample i sits at input coordinate (i + 0.5)·scale − 0.5.
    coord = (np.arange(60) + 0.5) * 0.5 - 0.5
    interior = (coord >= 0) & (coord <= 29)
    np.testing.assert_allclose(out[interior, 4, 4], coord[interior] * 10, atol=1e-4)
    ref = torch.nn.functional.interpolate(
        torch.from_numpy(vol)[None, None], size=(60, 8, 9), mode="trilinear", align_corners=False
    )[0, 0].numpy()
    np.testing.assert_array_equal(out, ref)
    assert ct.resampled_shape((300, 512, 512), (1.0, 0.68, 0.68), (1.5, 0.75, 0.75)) == (
        200,
        464,
        464,
    )


def test_crop_or_pad_centres_against_explicit_slicing():
    vol = np.arange(5 * 6 * 7, dtype=np.float32).reshape(5, 6, 7)
    out = ct.crop_or_pad(vol, (9, 4, 7), fill=-1)
    expected = np.full((9, 4, 7), -1, dtype=np.float32)
    expected[2:7] = vol[:, 1:5, :]
    np.testing.assert_array_equal(out, expected)


def test_ct_clip_preset_end_to_end():
    rng = np.random.default_rng(1)
    hu = rng.integers(-1200, 2000, size=(40, 96, 80)).astype(np.int16)
    out = ct.preprocess(hu.astype(np.float32), (5.0, 3.6, 3.6), ct.CT_CLIP)
    assert out.shape == (240, 480, 480) and out.dtype == np.float32
    assert out.min() >= -1 and out.max() <= 1
    assert out[0, 0, 0] == -1 and out[-1, -1, -1] == -1  # padding
    assert ct.CT_CLIP.params()["spacing_zyx_mm"] == [1.5, 0.75, 0.75]
    assert ct.CT_CLIP.params()["axes"] == "zxy" and ct.CT_CLIP.params()["clip_first"]
    # Independent recomputation: clip, resample, /1000, in-plane axes swapped, crop/pad.
    clipped = np.clip(hu.astype(np.float32), -1000, 1000)
    ref = ct.resample(clipped, (5.0, 3.6, 3.6), (1.5, 0.75, 0.75)) / 1000
    got = ct.crop_or_pad(ref.transpose(0, 2, 1), (240, 480, 480), -1)
    np.testing.assert_allclose(out, got, atol=1e-5)


def test_ct_clip_differs_from_the_graph_hu_and_its_window_by_axes_and_clip_order():
    """The graph's ct_hu (HU preset with CT-CLIP's spacing and crop/pad) followed by the
    ``ct-clip`` window is CT-CLIP's volume only up to what docs/raw-data.md says: the in-plane
    axes are swapped, and clipping comes after resampling there (same where no voxel lies
    outside [-1000, 1000]; within float16 and int16 rounding)."""
    rng = np.random.default_rng(2)
    hu = rng.integers(-1000, 1000, size=(20, 48, 40)).astype(np.float32)
    spacing, shape = (3.0, 1.5, 1.5), (40, 64, 64)
    clip = ct.preprocess(hu, spacing, replace(ct.CT_CLIP, shape=shape)).transpose(0, 2, 1)
    graph = replace(ct.HU_ISOTROPIC, spacing=ct.CT_CLIP.spacing, shape=shape)
    window = ct.apply_window(ct.preprocess(hu, spacing, graph), "ct-clip", "float32")
    inside = clip > -1  # CT-CLIP pads with -1 (-1000 HU), the graph with -1024 HU
    np.testing.assert_allclose(2 * window[inside] - 1, clip[inside], atol=2e-3)


@pytest.mark.parametrize("preset", [ct.HU_ISOTROPIC, ct.CT_CLIP], ids=lambda p: p.name)
def test_preprocess_leaves_its_input_alone_at_the_target_spacing(preset):
    """A volume already at the preset's spacing is not resampled; the preset's clip must
    still work on a copy, not on the caller's HU volume."""
    hu = np.random.default_rng(0).uniform(-3000, 5000, (8, 6, 6)).astype(np.float32)
    before = hu.copy()
    ct.preprocess(hu, preset.spacing, replace(preset, shape=None))
    np.testing.assert_array_equal(hu, before)


def test_hu_preset_keeps_int16():
    hu = np.full((10, 20, 20), -1000, dtype=np.int16)
    out = ct.preprocess(hu, (3.0, 1.5, 1.5), ct.HU_ISOTROPIC)
    assert out.dtype == np.int16 and out.shape == (20, 40, 40) and np.all(out == -1000)


@pytest.mark.parametrize(
    "values",
    [[0.0, 0.25, 1.0], [0.5, 65504.0], [-0.0, 0.5], [-2.0, 3.0], [0.1, np.inf], [np.nan, 1.0]],
)
def test_finite_range_float16_matches_float64(values):
    x = np.array(values * 6, dtype=np.float16).reshape(3, -1)
    lo, hi, finite = finite_range(x)
    ref = x.astype(np.float64)
    assert finite == bool(np.isfinite(ref).all())
    if finite:
        assert (lo, hi) == (ref.min(), ref.max())


@pytest.mark.parametrize("size", [1, 5, (1 << 17) - 1, (1 << 17) + 3, 3 << 17])
def test_int16_percentiles_are_numpys_lower_percentiles(size):
    """Exact on every size, whole histogram blocks or not, full int16 range included."""
    x = np.random.default_rng(size).integers(-32768, 32768, size, dtype=np.int16)
    x[0] = -32768
    qs = (0, 1, 5, 50, 95, 99, 100)
    want = [int(np.percentile(x, q, method="lower")) for q in qs]
    assert int16_percentiles(x, qs) == want
    strided = np.repeat(x, 2)[::2]  # the same values, not contiguous
    assert int16_percentiles(strided, qs) == want
