"""HU from evidence: the decision, padding, plausibility and the user's override.

The volumes are chest phantoms (``zarrfeed.samples.ct_phantom``): true HU is known, so a
rescale off by 1024 shows as a wrong value, not as a different code path.
"""

import numpy as np
import pytest

from zarrfeed.errors import ConfigError, InputError
from zarrfeed.samples import ct_phantom
from zarrfeed.transforms import ct, hu
from zarrfeed.transforms.hu import Rescale

RAW = Rescale(1.0, -1024.0)


@pytest.fixture(scope="module")
def chest() -> np.ndarray:
    return ct_phantom((24, 64, 64), (5.0, 5.4, 5.4), ("Lung nodule",), np.random.default_rng(0))


def field_of_view(shape) -> np.ndarray:
    """True inside the scanner's circular reconstruction field, per slice."""
    y, x = np.ogrid[: shape[1], : shape[2]]
    r = (shape[1] - 1) / 2
    return np.broadcast_to((y - r) ** 2 + (x - r) ** 2 <= r**2, shape)


def test_raw_values_with_signed_padding_and_csv_intercept(chest):
    """Case (a): raw values padded with −2000 outside the field of view; the CSV says −1024."""
    inside = field_of_view(chest.shape)
    raw = np.where(inside, chest.astype(np.int16) + 1024, np.int16(-2000))
    assert raw.min() <= -500  # the old guess (minimum ≤ −500: "already HU") was 1024 off
    decision = hu.decide_hu(raw, "a.nii.gz", {"csv": RAW})
    assert (decision.source, decision.slope, decision.intercept) == ("csv", 1.0, -1024.0)
    assert decision.evidence["claims"]["csv"]["padding_share"] > 0.1
    out = hu.to_hu(raw, decision)
    np.testing.assert_array_equal(out[inside], chest[inside])
    assert np.all(out[~inside] == hu.AIR_FILL)  # padding is air, not −3024 HU


def test_header_only_scaling_decides_without_csv(chest):
    """Case (b) at the decision level (tests/test_formats.py reads it from a real file)."""
    raw = chest.astype(np.int16) + 1024
    decision = hu.decide_hu(raw, "b.nii.gz", {"nifti_header": RAW})
    assert decision.source == "nifti_header" and decision.rescale == RAW
    np.testing.assert_array_equal(hu.to_hu(raw, decision), chest)


def test_hu_crop_without_air_fails_loudly_or_takes_the_override(chest):
    """Case (c): an HU crop of spine and muscle, nothing below −500; the CSV says −1024."""
    crop = chest[:, 44:51, 24:40]
    assert crop.min() > -500  # the old guess ("raw") subtracted 1024 from HU again
    with pytest.raises(InputError, match=r"c\.nii\.gz.*csv .*refuted.*data as hu .*unconfirmed"):
        hu.decide_hu(crop, "c.nii.gz", {"csv": RAW})
    decision = hu.decide_hu(crop, "c.nii.gz", {"csv": RAW}, override="hu")
    assert decision.source == "override" and decision.rescale == hu.IDENTITY
    np.testing.assert_array_equal(hu.to_hu(crop, decision), crop)


def test_data_decides_when_no_source_claims(chest):
    assert hu.decide_hu(chest, "hu.npy").source == "data"
    assert hu.decide_hu(chest, "hu.npy").rescale == hu.IDENTITY
    raw = hu.decide_hu(chest.astype(np.int16) + 1024, "raw.npy")
    assert (raw.source, raw.rescale, raw.evidence["data_says"]) == ("data", RAW, "raw")


def test_csv_is_overruled_only_when_impossible_for_the_file(chest):
    """A re-exported volume that already holds HU keeps the CSV's −1024 (CT-RATE *_fixed)."""
    decision = hu.decide_hu(chest, "fixed.nii.gz", {"csv": RAW})
    assert decision.source == "data" and decision.rescale == hu.IDENTITY
    assert decision.evidence["overruled"] == ["csv"]
    assert decision.evidence["claims"]["csv"]["below_share"] > 0.3  # air would be −2024 HU


def test_a_file_claim_the_data_contradicts_fails(chest):
    with pytest.raises(InputError, match=r"d\.nii\.gz.*nifti_header .*refuted"):
        hu.decide_hu(chest, "d.nii.gz", {"nifti_header": RAW, "csv": RAW})
    raw = chest.astype(np.int16) + 1024  # DICOM tags promised HU, the values are raw
    with pytest.raises(InputError, match=r"dicom .*unconfirmed.*data as raw .*fits"):
        hu.decide_hu(raw, "series", {"dicom": hu.IDENTITY})


def test_claims_that_disagree_fail_even_when_both_fit(chest):
    raw = chest.astype(np.int16) + 1024
    with pytest.raises(InputError, match="claims that agree"):
        hu.decide_hu(raw, "e.nii.gz", {"nifti_header": RAW, "csv": Rescale(1.0, -1000.0)})
    agreed = hu.decide_hu(raw, "e.nii.gz", {"nifti_header": RAW, "csv": RAW})
    assert agreed.source == "nifti_header"  # the first source that fits is credited


@pytest.mark.parametrize("value", [-1000, 40, 1064])
def test_uniform_volumes_are_ambiguous(value):
    with pytest.raises(InputError, match=r"flat\.npy.*air and soft tissue"):
        hu.decide_hu(np.full((8, 16, 16), value, np.int16), "flat.npy")


def test_undeclared_padding_refutes_rather_than_counts_as_air(chest):
    padded = np.where(field_of_view(chest.shape), chest, np.int16(-1500))
    with pytest.raises(InputError, match="below −1100 HU"):
        hu.decide_hu(padded, "f.npy")
    declared = hu.decide_hu(padded, "f.npy", padding=~field_of_view(chest.shape))
    assert declared.rescale == hu.IDENTITY


def test_padding_becomes_air_before_resampling(chest):
    """−3024 outside the field of view, resampled as is, drags the body's edge below −1024."""
    inside = field_of_view(chest.shape)
    padded = np.where(inside, chest, np.int16(-3024))
    decision = hu.decide_hu(padded, "g.nii.gz")
    assert decision.evidence["data"]["hu"]["padding_share"] > 0.1
    filled = hu.to_hu(padded, decision)
    spacing, target = (5.0, 5.4, 5.4), (2.5, 2.0, 2.0)
    assert ct.resample(padded.astype(np.float32), spacing, target).min() < -2000  # smeared
    assert ct.resample(filled, spacing, target).min() >= hu.AIR_FILL


def test_plausibility_blocks_any_volume_off_by_1024(chest):
    spacing = (5.0, 0.7, 0.7)  # about the stored spacing in-plane, as for real scans
    stored = ct.preprocess(chest, spacing, ct.HU_ISOTROPIC)  # what the store holds
    passed, facts = hu.hu_plausibility(stored)
    assert passed and facts["air_peak_hu"] == -1000 and facts["tissue_share"] > 0.2
    for shift in (1024, -1024):
        shifted = ct.preprocess(chest + shift, spacing, ct.HU_ISOTROPIC)
        assert not hu.hu_plausibility(shifted)[0], shift
    # +1024 with its padding filled as air: the fill is no evidence of air.
    inside = field_of_view(chest.shape)
    fake = np.where(inside, chest + 1024, np.float32(hu.AIR_FILL))
    assert not hu.hu_plausibility(fake, outside=~inside)[0]
    assert hu.hu_plausibility(np.where(inside, chest, np.float32(hu.AIR_FILL)), ~inside)[0]
    assert not hu.hu_plausibility(np.full((10, 20, 20), -1000, np.int16))[0]  # all air


def test_override_format_and_csv_rows():
    assert hu.parse_overrides({"a": "hu", "b": {"slope": 1, "intercept": -1024}}) == {
        "a": hu.IDENTITY,
        "b": RAW,
    }
    for bad in ("HU", {"slope": 1}, {"slope": 0, "intercept": 0}, {"slope": "x", "intercept": 0}):
        with pytest.raises(ConfigError, match="'hu' or"):
            hu.parse_overrides({"k": bad})
    row = {"VolumeName": "v.nii.gz", "RescaleSlope": "1", "RescaleIntercept": "-1024"}
    assert hu.csv_rescale(row) == RAW
    assert hu.csv_rescale({"VolumeName": "v.nii.gz", "RescaleSlope": ""}) is None
    assert hu.csv_rescale(None) is None
    with pytest.raises(InputError, match="numeric RescaleSlope"):
        hu.csv_rescale({**row, "RescaleIntercept": "minus"}, "meta.csv")
    with pytest.raises(ValueError, match="unknown HU claim"):
        hu.decide_hu(np.zeros((2, 2, 2)), "x", {"header": RAW})


def test_large_volumes_are_sampled_not_aliased(chest):
    """Over EVIDENCE_VOXELS the evidence is a fixed random sample: same answer as all voxels."""
    big = np.tile(chest, (8, 4, 4))  # 192×256×256 > 2**20 voxels
    decision = hu.decide_hu(big, "big.nii.gz", {"csv": RAW})
    small = hu.decide_hu(chest, "small.nii.gz", {"csv": RAW})
    assert decision.evidence["data"]["hu"]["voxels"] == hu.EVIDENCE_VOXELS
    for name in ("air_share", "tissue_share"):
        assert decision.evidence["data"]["hu"][name] == pytest.approx(
            small.evidence["data"]["hu"][name], abs=0.01
        )


def test_the_sample_takes_one_voxel_per_run_whatever_the_memory_layout(chest):
    """Stratified: sorted positions, one in each of EVIDENCE_VOXELS equal runs of the logical
    (C-order) volume, so a transposed view samples exactly what its contiguous copy does."""
    big = np.tile(chest, (8, 4, 4))
    padding = big < -1500
    view = big.transpose(2, 0, 1)
    values, flags = hu._sample(view, padding.transpose(2, 0, 1))
    copy_values, copy_flags = hu._sample(np.ascontiguousarray(view), None)
    np.testing.assert_array_equal(values, copy_values)
    assert copy_flags is None and flags.dtype == bool and values.size == hu.EVIDENCE_VOXELS
    np.testing.assert_array_equal(flags, values < -1500)
    # every run of the flat volume holds exactly one sample: ids (position // run) are 0..n-1
    marked = np.arange(big.size, dtype=np.float64).reshape(big.shape)
    positions, _ = hu._sample(marked, None)
    run = big.size / hu.EVIDENCE_VOXELS
    np.testing.assert_array_equal(
        np.floor(positions / run).astype(np.int64), np.arange(hu.EVIDENCE_VOXELS)
    )


def test_the_ct_settings_refuse_a_malformed_hu_override_when_loaded():
    """A typo in the CT component's hu_overrides fails the code location's load, naming the
    scan, instead of failing that scan's partition later."""
    from pydantic import ValidationError

    from zarrfeed.families.ct import CT, CTSettings

    given = {"a": "hu", "b": {"slope": 1, "intercept": -1024}}
    assert CTSettings(hu_overrides=given).hu_overrides == given  # kept as written
    for bad in ("HU", {"slope": 1}):
        with pytest.raises(ValidationError, match=r"HU override for 'k'.*'hu' or"):
            CT.values({"hu_overrides": {"k": bad}})


@pytest.mark.parametrize("order", ["C", "F"])
def test_to_hu_is_the_float32_rescale_with_sentinels_as_air_in_any_block(order):
    """Converted block by block: every voxel is ``stored · slope + intercept`` in float32, a
    sentinel is air wherever it lies (here only in the last block), whatever the layout."""
    rng = np.random.default_rng(1)
    stored = np.array(rng.integers(0, 4096, (3, 301, 401), dtype=np.int16), order=order)
    stored[-1, -1, -3:] = -3024  # stored padding, past the first blocks
    out = hu.to_hu(stored, Rescale(2.0, -1024.0))
    want = stored.astype(np.float32) * np.float32(2.0) + np.float32(-1024.0)
    want[-1, -1, -3:] = hu.AIR_FILL
    assert out.dtype == np.float32 and np.array_equal(out, want)
    clean = stored.copy()
    clean[-1, -1, -3:] = 5
    assert np.array_equal(hu.to_hu(clean, RAW), clean.astype(np.float32) - 1024)


def test_to_hu_of_a_reoriented_volume_allocates_only_its_output():
    """Readers hand over views brought to RAS (a DICOM series or an LPS NIfTI: rows and
    columns reversed), which no flat reshape can see without a copy: the conversion reads
    them slab by slab instead of copying the whole stored volume first."""
    import tracemalloc

    rng = np.random.default_rng(2)
    volume = rng.uniform(-1000, 1000, (40, 128, 128)).astype(np.float32)
    view = volume[:, ::-1, ::-1]
    tracemalloc.start()
    try:
        out = hu.to_hu(view, Rescale(0.5, -24.0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(out, view * np.float32(0.5) + np.float32(-24.0))
    assert peak < out.nbytes * 1.25, f"{peak} bytes for a {out.nbytes}-byte output"


def test_to_hu_finds_sentinels_without_volume_sized_masks():
    """Out-of-field sentinels (here -3024 around a GE-like field of view) are found block by
    block: no full-size masks per sentinel value on top of the output."""
    import tracemalloc

    stored = np.full((40, 128, 128), 40, dtype=np.int16)
    stored[:, :16] = -3024
    stored[:, -16:] = -2000
    tracemalloc.start()
    try:
        out = hu.to_hu(stored, Rescale(1.0, 0.0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    want = np.where(stored < -1024, hu.AIR_FILL, stored).astype(np.float32)
    assert np.array_equal(out, want)
    assert peak < out.nbytes * 1.25, f"{peak} bytes for a {out.nbytes}-byte output"


def test_a_nan_beside_a_sentinel_in_one_block_does_not_hide_it():
    """A float volume with NaN and a -3024 sentinel in the same block: the sentinel is still
    air (a block's plain minimum is NaN there, which would skip the sentinel search)."""
    stored = np.full((4, 64, 64), 40.0, dtype=np.float32)
    stored[0, 0, 0] = np.nan
    stored[0, 0, 1] = -3024.0
    out = hu.to_hu(stored, RAW)
    assert out[0, 0, 1] == hu.AIR_FILL and np.isnan(out[0, 0, 0])
    assert np.all(out.reshape(-1)[2:] == 40.0 - 1024)
