import numpy as np
import pytest

from zarrfeed.transforms import sparse
from zarrfeed.transforms.ct import apply_window


def test_coords_equal_argwhere():
    vol = np.random.default_rng(0).random((37, 41, 29)) > 0.97
    got = sparse.coords_from_mask(vol)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, np.argwhere(vol))


def test_occupancy_threshold_and_downsample_against_block_loop():
    rng = np.random.default_rng(1)
    vol = rng.random((64, 64, 64)).astype(np.float32)
    np.testing.assert_array_equal(sparse.occupancy_coords(vol, 0.99), np.argwhere(vol > 0.99))
    mask = vol > 0.999
    got = sparse.downsample_occupancy(mask, 16)
    ref = np.zeros((16, 16, 16), dtype=bool)
    for i, j, k in np.ndindex(16, 16, 16):
        ref[i, j, k] = mask[4 * i : 4 * i + 4, 4 * j : 4 * j + 4, 4 * k : 4 * k + 4].any()
    np.testing.assert_array_equal(got, ref)
    odd = mask[:63, :62, :7]  # not a multiple of the grid; the last axis even upsamples
    ref_odd = np.zeros((16, 16, 16), dtype=bool)
    for v in np.argwhere(odd):  # voxel i of an n-long axis belongs to cell floor(i * 16 / n)
        ref_odd[tuple(v * 16 // np.array(odd.shape))] = True
    np.testing.assert_array_equal(sparse.downsample_occupancy(odd, 16), ref_odd)
    coords = sparse.occupancy_coords(vol, 0.999, grid=16)
    dense = np.zeros((16, 16, 16), dtype=bool)
    dense[tuple(coords.T.astype(np.intp))] = True  # the TRELLIS ss[coords] = 1
    np.testing.assert_array_equal(dense, ref)


@pytest.mark.parametrize("shape", [(64, 64, 64), (63, 70, 7), (40, 96, 96)])
def test_window_occupancy_from_hu_equals_thresholding_each_window(shape):
    rng = np.random.default_rng(2)
    hu = rng.integers(-1024, 3072, shape).astype(np.int16)
    hu[rng.random(shape) < 0.7] = -1000  # mostly air, so cells differ between windows
    windows = ["lung", "mediastinum", "bone"]
    for threshold, grid in ((0.5, 16), (0.0, 16), (0.9, (8, 32, 16)), (0.5, None)):
        got = sparse.window_occupancy(hu, windows, threshold, grid)
        for w in windows:
            want = sparse.occupancy_coords(apply_window(hu, w), threshold, grid)
            np.testing.assert_array_equal(got[w], want, err_msg=f"{w} {threshold} {grid}")
    assert len({len(c) for c in got.values()}) > 1  # the windows really differ


def test_sampling_is_deterministic_and_bounded():
    coords = sparse.coords_from_mask(np.random.default_rng(2).random((30, 30, 30)) > 0.5)
    a = sparse.sample_points(coords, 100, 500, seed=7)
    b = sparse.sample_points(coords, 100, 500, seed=7)
    c = sparse.sample_points(coords, 100, 500, seed=8)
    assert len(a) == 500 and np.array_equal(a, b) and not np.array_equal(a, c)
    rows = {tuple(r) for r in coords.tolist()}
    assert all(tuple(r) in rows for r in a.tolist())
    assert len({tuple(r) for r in a.tolist()}) == 500  # without replacement
    assert sparse.sample_points(coords[:150], 100, 500) is not None
    with pytest.raises(sparse.TooFewPointsError, match="min_points=100"):
        sparse.sample_points(coords[:99], 100, 500)
