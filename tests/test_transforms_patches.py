from itertools import product

import numpy as np
import pytest

from zarrfeed.transforms.defects import Defects, gaussian_kernel, random_defects, render_defects
from zarrfeed.transforms.patches import PatchGrid, patch_fractions


def explicit_origins(shape, patch, stride):
    axes = []
    for n, p, s in zip(shape, patch, stride, strict=True):
        pos = list(range(0, n - p + 1, s))
        if pos[-1] != n - p:
            pos.append(n - p)
        axes.append(pos)
    return [tuple(o) for o in product(*axes)]


@pytest.mark.parametrize(("shape", "patch", "stride"), [
    ((976, 176), (128, 128), (112, 112)),
    ((240, 480, 480), (64, 64, 64), (64, 64, 64)),
    ((30, 31, 17), (8, 8, 8), (5, 7, 3)),
])  # fmt: skip
def test_grid_matches_explicit_list(shape, patch, stride):
    grid = PatchGrid.make(shape, patch, stride)
    ref = explicit_origins(shape, patch, stride)
    assert len(grid) == len(ref)
    assert [tuple(o) for o in grid.origins().tolist()] == ref
    for i in (0, len(ref) // 2, len(ref) - 1):
        assert grid.origin(i) == ref[i]


@pytest.mark.parametrize(
    ("shape", "patch", "stride"),
    [
        ((40, 33, 27), (8, 8, 8), (6, 5, 4)),
        ((70, 50, 45), (16, 16, 16), (16, 16, 16)),
        ((600, 12, 10), (300, 4, 5), (300, 4, 5)),  # first-axis counts above 255
    ],
)
def test_fractions_match_brute_force(shape, patch, stride):
    mask = np.random.default_rng(0).random(shape) > (0.7 if shape[0] < 300 else 0.05)
    grid = PatchGrid.make(mask.shape, patch, stride)
    got = patch_fractions(mask, grid)
    ref = [mask[grid.slices(i)].mean() for i in range(len(grid))]
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_local_defects_equal_full_image_rendering():
    rng = np.random.default_rng(3)
    image = rng.random((128, 128)).astype(np.float32)
    defects = Defects(
        centers=np.array([[0, 0], [64, 70], [127, 10], [30, 127]]),
        sizes=np.array([[3, 3], [3, 5], [5, 7], [3, 5]]),
        sigmas=np.array([[1.0, 1.0], [1.0, 1.5], [1.5, 2.0], [1.0, 1.5]]),
        amplitudes=np.array([0.3, -0.4, 0.5, 0.2]),
        in_mask=np.array([True, False, True, True]),
    )
    out, mask = render_defects(image, defects)
    yy, xx = np.mgrid[:128, :128]  # seed 002's first version: full-image meshgrids
    ref, ref_mask = image.astype(np.float64).copy(), np.zeros((128, 128), dtype=np.uint8)
    for (cy, cx), (h, w), (sy, sx), a, m in zip(
        defects.centers,
        defects.sizes,
        defects.sigmas,
        defects.amplitudes,
        defects.in_mask,
        strict=True,
    ):
        g = np.exp(-((yy - cy) ** 2 / (2 * sy**2) + (xx - cx) ** 2 / (2 * sx**2)))
        support = (np.abs(yy - cy) <= h // 2) & (np.abs(xx - cx) <= w // 2)
        ref += a * g * support
        if m:
            ref_mask |= (support & (g >= 0.5)).astype(np.uint8)
    np.testing.assert_allclose(out, ref, atol=1e-6)
    np.testing.assert_array_equal(mask, ref_mask)


def test_random_defects_follow_seed_002_recipe_and_kernels_are_cached():
    rng = np.random.default_rng(4)
    drawn = [random_defects((128, 128), rng) for _ in range(400)]
    counts = np.array([len(d) for d in drawn])
    assert 0.4 < np.mean(counts > 0) < 0.6
    assert set(counts[counts > 0]) <= set(range(3, 9))
    assert all(d.in_mask.sum() <= 2 for d in drawn)
    gaussian_kernel.cache_clear()
    for d in drawn:
        render_defects(np.zeros((128, 128), np.float32), d)
    assert gaussian_kernel.cache_info().currsize == 2
    assert not gaussian_kernel((3, 3), (1.0, 1.0)).flags.writeable
