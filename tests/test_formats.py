import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.pixels import apply_modality_lut

from zarrfeed.errors import InputError
from zarrfeed.formats import (
    read_dicom_series,
    read_image,
    read_nifti,
    read_nifti_header,
    read_npy,
    read_npz,
    write_image,
    write_nifti,
)  # fmt: skip


def test_dicom_series_is_ordered_and_rescaled():
    """CT5N in pydicom's test files: a real five-slice CT series shrunk to 16×16."""
    folder = get_testdata_file("CT_small.dcm").rsplit("/", 1)[0] + "/dicomdirtests/98892001/CT5N"
    vol = read_dicom_series(folder)
    assert vol.shape == (5, 16, 16)
    z = vol.meta["slice_positions_mm"]
    assert z == sorted(z) and vol.spacing[0] == pytest.approx(2.5, abs=1e-3)
    assert not vol.meta["irregular_spacing"]
    for i, f in enumerate(vol.meta["files"]):
        ds = pydicom.dcmread(f)
        np.testing.assert_allclose(vol.data[i], apply_modality_lut(ds.pixel_array, ds))
    assert -1100 < vol.data.min() < -800  # air in HU: the rescale was applied


def test_single_dicom_slice_and_irregular_series():
    vol = read_dicom_series(get_testdata_file("CT_small.dcm"))
    assert vol.shape == (1, 128, 128) and vol.spacing[1] == pytest.approx(0.661468, abs=1e-5)
    head = get_testdata_file("CT_small.dcm").rsplit("/", 1)[0] + "/dicomdirtests/77654033/CT2"
    assert read_dicom_series(head).meta["irregular_spacing"]


def test_dicom_folder_without_images_names_it(tmp_path):
    (tmp_path / "notes.txt").write_text("not dicom")
    with pytest.raises(InputError, match="pixel data"):
        read_dicom_series(tmp_path)


def test_nifti_round_trip_spacing_and_orientation(tmp_path):
    data = np.arange(4 * 5 * 6, dtype=np.int16).reshape(4, 5, 6)
    write_nifti(tmp_path / "v.nii.gz", data, (2.5, 0.7, 0.8))
    vol = read_nifti(tmp_path / "v.nii.gz")
    np.testing.assert_array_equal(vol.data, data)
    assert vol.spacing == pytest.approx((2.5, 0.7, 0.8)) and vol.meta["orientation"] == "RAS"
    write_nifti(tmp_path / "s.nii.gz", data, (1, 1, 1), slope=2.0, intercept=-1024.0)
    scaled = read_nifti(tmp_path / "s.nii.gz")
    assert (scaled.slope, scaled.intercept) == (2.0, -1024.0)
    np.testing.assert_array_equal(scaled.data, data)  # stored values, scaling kept apart
    import nibabel as nib  # NIfTI-2, gzipped: inflated by igzip, then parsed by nibabel

    nib.save(nib.Nifti2Image(data.transpose(2, 1, 0), np.eye(4)), tmp_path / "n2.nii.gz")
    np.testing.assert_array_equal(read_nifti(tmp_path / "n2.nii.gz").data, data)
    noisy = np.random.default_rng(0).integers(0, 3000, (40, 40, 40)).astype(np.int16)
    write_nifti(tmp_path / "big.nii.gz", noisy, (1, 1, 1))
    cut = tmp_path / "cut.nii.gz"  # a truncated download: the header reads, the voxels end
    cut.write_bytes((tmp_path / "big.nii.gz").read_bytes()[:-2000])
    assert read_nifti_header(cut).shape == (40, 40, 40)
    with pytest.raises(InputError, match=r"cut\.nii\.gz.*unreadable"):
        read_nifti(cut)


def test_nifti_reorients_an_lps_file_to_canonical(tmp_path):
    import nibabel as nib

    xyz = np.random.default_rng(0).integers(0, 100, size=(6, 5, 4)).astype(np.int16)
    nib.save(nib.Nifti1Image(xyz, np.diag([-0.5, -0.5, 2.0, 1.0])), tmp_path / "lps.nii")
    vol = read_nifti(tmp_path / "lps.nii")
    assert vol.meta["orientation_on_disk"] == "LPS" and vol.meta["orientation"] == "RAS"
    np.testing.assert_array_equal(vol.data, xyz[::-1, ::-1, :].transpose(2, 1, 0))
    # A permuted, anisotropic file: the header alone must give read_nifti's shape and spacing.
    nib.save(nib.Nifti1Image(xyz, np.array([[0, 0, 3.0, 0], [-0.5, 0, 0, 0], [0, 0.7, 0, 0],
                                            [0, 0, 0, 1]])), tmp_path / "perm.nii")  # fmt: skip
    for name in ("lps.nii", "perm.nii"):
        header, full = read_nifti_header(tmp_path / name), read_nifti(tmp_path / name)
        assert header.shape == full.shape and header.spacing == pytest.approx(full.spacing)
        assert header.meta["dtype"] == "int16"
    bad = tmp_path / "bad.nii.gz"
    bad.write_bytes(b"garbage")
    with pytest.raises(InputError, match=r"bad\.nii\.gz"):
        read_nifti(bad)
    with pytest.raises(InputError, match=r"bad\.nii\.gz"):
        read_nifti_header(bad)


def test_npy_npz_refuse_pickles_and_name_keys(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(10))
    assert isinstance(read_npy(tmp_path / "a.npy"), np.memmap)
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match=r"o\.npy"):
        read_npy(tmp_path / "o.npy", mmap=False)
    np.savez(tmp_path / "z.npz", coords=np.ones(3), sdf=np.zeros(3))
    np.testing.assert_array_equal(read_npz(tmp_path / "z.npz", "coords"), np.ones(3))
    with pytest.raises(InputError, match=r"z\.npz.*'index'.*\['coords', 'sdf'\]"):
        read_npz(tmp_path / "z.npz", "index")
    with pytest.raises(InputError, match="exactly one array"):
        read_npz(tmp_path / "z.npz")


@pytest.mark.parametrize(("name", "dtype"), [("i.png", np.uint8), ("i.tif", np.float32)])
def test_images_round_trip(tmp_path, name, dtype):
    img = (np.random.default_rng(0).random((976, 176, 3)) * 200).astype(dtype)
    write_image(tmp_path / name, img)
    got = read_image(tmp_path / name)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, img)
    (tmp_path / "x.png").write_bytes(b"nope")
    with pytest.raises(InputError, match=r"x\.png"):
        read_image(tmp_path / "x.png")
