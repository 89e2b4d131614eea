import numpy as np
import pytest
from PIL import Image

from zarrfeed.errors import InputError
from zarrfeed.formats import read_dat, write_dat
from zarrfeed.transforms import spike as sp


def test_packed_decoding_of_real_camera_files(spikezoo_data):
    """spikezoo ships REDS recordings (301 frames of 250×400) with ground-truth images."""
    for dat in sorted((spikezoo_data / "test" / "spike").glob("*.dat")):
        spikes = read_dat(dat, 250, 400)
        assert spikes.shape == (301, 250, 400)
        gt = np.asarray(Image.open(spikezoo_data / "test" / "gt" / f"{dat.stem}.png").convert("L"))
        img = spikes[130:171].mean(axis=0, dtype=np.float32)  # texture from playback
        corr = np.corrcoef(img.ravel(), gt.ravel().astype(np.float32))[0, 1]
        assert corr > 0.9, f"{dat.name}: TFP vs ground truth corr {corr:.3f}"
        flipped = np.corrcoef(img[::-1].ravel(), gt.ravel().astype(np.float32))[0, 1]
        assert flipped < 0.5  # the vertical flip is real, not a convention we made up
        assert sp.encode_packed(spikes).tobytes() == dat.read_bytes()


def test_packed_layout_bit_order_against_a_hand_made_frame():
    frame = np.zeros((1, 2, 8), dtype=np.uint8)
    frame[0, 1, 0] = 1  # bottom row, first pixel → first byte after the flip, bit 0
    frame[0, 0, 3] = 1  # top row, pixel 3 → second byte, bit 3
    assert sp.encode_packed(frame).tolist() == [0b00000001, 0b00001000]
    np.testing.assert_array_equal(sp.decode_packed(np.array([1, 8], np.uint8), 2, 8), frame)


def test_size_checks_name_file_expected_and_found(tmp_path):
    bad = tmp_path / "000001.dat"
    bad.write_bytes(b"\0" * 2_534_399)
    with pytest.raises(InputError) as err:
        read_dat(bad, 396, 640, layout="bytes", frames=10)
    msg = str(err.value)
    assert "000001.dat" in msg and "2534400" in msg and "2534399" in msg and "reshape" in msg
    with pytest.raises(InputError, match=r"32000-byte frames.*found 32001 bytes"):
        bad.write_bytes(b"\0" * 32001)
        read_dat(bad, 640, 400)
    good = np.random.default_rng(0).integers(0, 2, size=(10, 396, 640), dtype=np.uint8)
    write_dat(tmp_path / "ok.dat", good, layout="bytes")
    np.testing.assert_array_equal(read_dat(tmp_path / "ok.dat", 396, 640, "bytes", frames=10), good)


@pytest.mark.parametrize(("frames", "bins"), [(10, 5), (11, 4), (7, 7), (600, 2)])
def test_voxel_bins_against_a_loop(frames, bins):
    spikes = np.random.default_rng(frames).integers(0, 2, size=(frames, 9, 13), dtype=np.uint8)
    got = sp.voxel_bins(spikes, bins)
    groups = np.array_split(np.arange(frames), bins)
    ref = np.zeros((bins, 9, 13), dtype=np.int64)
    for b, g in enumerate(groups):
        for f in g:
            for y in range(9):
                for x in range(13):
                    ref[b, y, x] += spikes[f, y, x]
    np.testing.assert_array_equal(got, ref)
    assert got.dtype == (np.uint8 if frames // bins < 256 else np.uint16)


def test_simulator_rate_follows_intensity():
    levels = np.linspace(0, 1, 11, dtype=np.float32)
    frames = np.broadcast_to(levels[None, None, :], (400, 20, 11))
    spikes = sp.simulate_spikes(frames, threshold=2.0, seed=0)
    rate = spikes.mean(axis=(0, 1))
    np.testing.assert_allclose(rate, levels / 2.0, atol=0.01)
    assert np.array_equal(spikes, sp.simulate_spikes(frames, threshold=2.0, seed=0))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sp.simulate_spikes(frames * 2)
