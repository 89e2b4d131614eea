import dataclasses
import importlib.util
import json
import zipfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.pixels import apply_modality_lut

from zarrfeed.errors import InputError
from zarrfeed.families.ct import CT
from zarrfeed.families.ct import tables as ct_rate
from zarrfeed.families.ct.discover import discover_ct
from zarrfeed.families.images import IMAGES
from zarrfeed.families.images.discover import discover_image_sets
from zarrfeed.families.registry import family_tree
from zarrfeed.families.spike.discover import discover_spike_sequences
from zarrfeed.formats import dicom as dicom_module
from zarrfeed.formats import (
    read_array_volume,
    read_ct,
    read_dicom_series,
    read_image,
    read_nifti,
    read_nifti_header,
    read_npy,
    read_npz,
    write_dicom_series,
    write_image,
    write_nifti,
)
from zarrfeed.samples import ct_phantom, make_ct_sources
from zarrfeed.transforms import ct
from zarrfeed.transforms.hu import Rescale, hu_plausibility


def test_dicom_series_is_ordered_and_rescaled():
    """CT5N in pydicom's test files: a real five-slice CT series shrunk to 16×16."""
    folder = get_testdata_file("CT_small.dcm").rsplit("/", 1)[0] + "/dicomdirtests/98892001/CT5N"
    vol = read_dicom_series(folder)
    assert vol.shape == (5, 16, 16)
    z = vol.meta["slice_positions_mm"]
    assert z == sorted(z) and vol.spacing[0] == pytest.approx(2.5, abs=1e-3)
    # Stored head-first supine: rows run to the left (L), columns to the back (P); zarrfeed's
    # (z, y, x) is (S, A, R), as for NIfTI, so both in-plane axes are flipped.
    assert (vol.meta["orientation_on_disk"], vol.meta["orientation"]) == ("LPS", "RAS")
    for i, f in enumerate(vol.meta["files"]):
        ds = pydicom.dcmread(f)
        np.testing.assert_allclose(vol.data[i], apply_modality_lut(ds.pixel_array, ds)[::-1, ::-1])
    assert -1100 < vol.data.min() < -800  # air in HU: the rescale was applied


def test_single_dicom_slice_and_a_series_with_a_gap():
    vol = read_dicom_series(get_testdata_file("CT_small.dcm"))
    assert vol.shape == (1, 128, 128) and vol.spacing[1] == pytest.approx(0.661468, abs=1e-5)
    head = get_testdata_file("CT_small.dcm").rsplit("/", 1)[0] + "/dicomdirtests/77654033/CT2"
    with pytest.raises(InputError, match=r"evenly spaced slices, 1\.25 mm apart .* found 202\.5"):
        read_dicom_series(head)  # 202.5 mm, then 1.25 mm: resampled, it would be squashed


def test_dicom_and_nifti_of_one_scan_give_one_array(tmp_path):
    """The same (S, A, R) volume written as a NIfTI and as an axial DICOM series reads back
    identically: one orientation for every source."""
    stored = np.arange(4 * 5 * 6, dtype=np.int16).reshape(4, 5, 6) - 1000
    write_dicom_series(tmp_path / "dcm", stored, (2.0, 0.8, 0.7), intercept=0)
    write_nifti(tmp_path / "v.nii.gz", stored, (2.0, 0.8, 0.7), slope=1, intercept=0)
    dicom, nifti = read_dicom_series(tmp_path / "dcm"), read_nifti(tmp_path / "v.nii.gz")
    np.testing.assert_array_equal(dicom.data, nifti.data)
    assert dicom.spacing == pytest.approx(nifti.spacing)
    assert dicom.meta["orientation"] == nifti.meta["orientation"] == "RAS"


def oriented_series(folder, orient, positions, pixels):
    """Slices of ``pixels`` (k, j, i) with ``orient`` and one position per slice."""
    folder.mkdir()
    blank = np.zeros((len(positions), *pixels.shape[1:]), np.int16)
    write_dicom_series(folder, blank, (1, 1, 1), intercept=0)
    files = sorted(folder.iterdir())
    for f, pos, plane in zip(files, positions, pixels, strict=True):
        ds = pydicom.dcmread(f)
        ds.ImageOrientationPatient, ds.ImagePositionPatient = orient, list(pos)
        ds.PixelData = np.ascontiguousarray(plane, "<i2").tobytes()
        ds.save_as(f, enforce_file_format=True)
    return files


def test_feet_first_and_coronal_series_come_out_in_one_orientation(tmp_path):
    pixels = np.arange(3 * 4 * 5, dtype=np.int16).reshape(3, 4, 5)
    # Positions that descend while the file order ascends: sorted along the normal.
    oriented_series(tmp_path / "ff", [1, 0, 0, 0, 1, 0], [(0, 0, -z) for z in range(3)], pixels)
    vol = read_dicom_series(tmp_path / "ff")
    np.testing.assert_array_equal(vol.data, pixels[::-1, ::-1, ::-1])
    # Coronal: rows run to the left, columns down (−S), slices step to the back (+P).
    oriented_series(tmp_path / "cor", [1, 0, 0, 0, 0, -1], [(0, y, 0) for y in range(3)], pixels)
    vol = read_dicom_series(tmp_path / "cor")
    assert vol.meta["orientation_on_disk"] == "LIP" and vol.shape == (4, 3, 5)
    np.testing.assert_array_equal(vol.data, pixels.transpose(1, 0, 2)[::-1, ::-1, ::-1])


def test_tilted_missing_and_malformed_slices_fail_naming_the_file(tmp_path):
    pixels = np.zeros((4, 4, 4), np.int16)
    tilt = [(0, 0.9 * z, 2.5 * z) for z in range(4)]  # a 20° gantry tilt
    files = oriented_series(tmp_path / "tilt", [1, 0, 0, 0, 1, 0], tilt, pixels)
    with pytest.raises(InputError, match=rf"{files[1]}: .*no gantry tilt.*sideways"):
        read_dicom_series(tmp_path / "tilt")
    gap = [(0, 0, z) for z in (0, 2.5, 5, 10)]  # the slice at 7.5 mm is missing
    files = oriented_series(tmp_path / "gap", [1, 0, 0, 0, 1, 0], gap, pixels)
    with pytest.raises(InputError, match=rf"{files[3]}: expected evenly spaced slices"):
        read_dicom_series(tmp_path / "gap")
    files = copy_series(CT5N, tmp_path / "empty", lambda i, ds: i == 1 and setattr(
        ds, "RescaleSlope", None))  # fmt: skip
    with pytest.raises(InputError, match=r"1 number in RescaleSlope"):
        read_dicom_series(tmp_path / "empty")
    copy_series(CT5N, tmp_path / "iop", lambda i, ds: setattr(ds, "ImageOrientationPatient", []))
    with pytest.raises(InputError, match=r"6 numbers in ImageOrientationPatient"):
        read_dicom_series(tmp_path / "iop")
    zero = [0, 0, 0, 0, 0, 0]  # as some anonymisers write it
    copy_series(CT5N, tmp_path / "zero", lambda i, ds: setattr(ds, "ImageOrientationPatient", zero))
    with pytest.raises(InputError, match=r"two orthogonal unit cosines"):
        read_dicom_series(tmp_path / "zero")


def test_positions_rounded_to_few_decimals_still_make_one_stack(tmp_path):
    """0.625 mm slices whose positions a scanner wrote to two decimals: each gap is 0.62 or
    0.63 mm, the stack is even, and the spacing is the fitted one."""
    pixels = np.zeros((9, 4, 4), np.int16)
    rounded = [(0, 0, round(0.625 * k, 2)) for k in range(9)]
    oriented_series(tmp_path / "r", [1, 0, 0, 0, 1, 0], rounded, pixels)
    assert read_dicom_series(tmp_path / "r").spacing[0] == pytest.approx(0.625, abs=1e-3)


def test_slice_files_are_listed_as_data_runs(tmp_path):
    """A series whose normal points to the feet: files and positions follow data's z (S)."""
    pixels = np.arange(3)[:, None, None] * np.ones((3, 2, 2), np.int16)
    files = oriented_series(tmp_path / "f", [-1, 0, 0, 0, 1, 0], [(0, 0, -z) for z in (0, 10, 20)],
                            pixels)  # fmt: skip
    vol = read_dicom_series(tmp_path / "f")
    assert vol.meta["files"] == [str(f) for f in files[::-1]]
    for f, plane in zip(vol.meta["files"], vol.data, strict=True):
        assert plane[0, 0] == pydicom.dcmread(f).pixel_array[0, 0]


def test_padding_value_written_unsigned_on_signed_pixels(tmp_path):
    """PixelPaddingValue −1500 stored with VR US (64036) still marks the signed padding."""
    stored = np.full((2, 8, 8), 40, np.int16)
    stored[:, :2] = -1500
    write_dicom_series(tmp_path / "s", stored, (2, 1, 1), intercept=0)
    for f in (tmp_path / "s").iterdir():
        ds = pydicom.dcmread(f)
        ds.add_new(0x00280120, "US", 64036)
        ds.save_as(f, enforce_file_format=True)
    vol = read_dicom_series(tmp_path / "s")
    np.testing.assert_array_equal(vol.padding, stored == -1500)


def test_dicom_folder_without_images_names_it(tmp_path):
    (tmp_path / "notes.txt").write_text("not dicom")
    with pytest.raises(InputError, match="pixel data"):
        read_dicom_series(tmp_path)


def nifti_with(path, affine, units="mm", codes=(2, 0), pixdim=None, data=None, sform=None):
    """A NIfTI whose header says exactly this (nibabel would otherwise make it agree)."""
    data = np.arange(4 * 5 * 6, dtype=np.int16).reshape(4, 5, 6) if data is None else data
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(data.shape)
    hdr.set_data_dtype(data.dtype)
    hdr.set_sform(affine if sform is None else sform, codes[0])
    hdr.set_qform(affine, codes[1])
    sizes = np.linalg.norm(affine[:3, :3], axis=0)
    hdr["pixdim"][1:4] = sizes if pixdim is None else pixdim
    hdr.set_xyzt_units(units)
    nib.save(nib.Nifti1Image(data, None, header=hdr), path)
    return path


def test_nifti_units_codes_and_conflicting_voxel_sizes(tmp_path):
    # Micro-CT in microns and a header in metres: spacing in mm either way.
    micron = nifti_with(tmp_path / "um.nii.gz", np.diag([50, 50, 60, 1.0]), "micron")
    assert read_nifti(micron).spacing == pytest.approx((0.06, 0.05, 0.05))
    metre = nifti_with(tmp_path / "m.nii.gz", np.diag([0.0007, 0.0008, 0.0025, 1.0]), "meter")
    assert read_nifti(metre).spacing == pytest.approx((2.5, 0.8, 0.7))
    # pixdim and the sform disagree: spacing and orientation would come from two claims.
    both = nifti_with(tmp_path / "c.nii.gz", np.diag([0.7, 0.8, 2.5, 1.0]), pixdim=[1, 1, 1])
    with pytest.raises(InputError, match=r"c\.nii\.gz: expected voxel sizes in pixdim that agree"):
        read_nifti(both)
    # Neither sform nor qform: the standard's method 1 (no left-right flip), as stored.
    bare = nifti_with(tmp_path / "n.nii.gz", np.diag([-1, 1, 2, 1.0]), codes=(0, 0))
    stored = np.arange(4 * 5 * 6, dtype=np.int16).reshape(4, 5, 6)
    np.testing.assert_array_equal(read_nifti(bare).data, stored.transpose(2, 1, 0))
    # An all-zero sform beside a valid qform: the qform holds the geometry.
    zeroed = nifti_with(tmp_path / "z.nii.gz", np.diag([0.7, 0.8, 2.5, 1.0]), codes=(1, 1),
                        sform=np.zeros((4, 4)))  # fmt: skip
    assert read_nifti(zeroed).spacing == pytest.approx((2.5, 0.8, 0.7))
    # (x, y, z, 1, 1): one volume written as 5-D.
    five = nifti_with(tmp_path / "5.nii.gz", np.eye(4), data=stored[..., None, None])
    assert read_nifti(five).shape == (6, 5, 4)


def test_nifti_round_trip_spacing_and_orientation(tmp_path):
    data = np.arange(4 * 5 * 6, dtype=np.int16).reshape(4, 5, 6)
    write_nifti(tmp_path / "v.nii.gz", data, (2.5, 0.7, 0.8))
    vol = read_nifti(tmp_path / "v.nii.gz")
    np.testing.assert_array_equal(vol.data, data)
    assert vol.spacing == pytest.approx((2.5, 0.7, 0.8)) and vol.meta["orientation"] == "RAS"
    assert vol.claims == {}  # nibabel writes (1, 0) for unscaled data: no claim
    write_nifti(tmp_path / "s.nii.gz", data, (1, 1, 1), slope=2.0, intercept=-1024.0)
    scaled = read_nifti(tmp_path / "s.nii.gz")
    assert scaled.claims == {"nifti_header": Rescale(2.0, -1024.0)}
    np.testing.assert_array_equal(scaled.data, data)  # stored values, scaling kept apart

    nib.save(nib.Nifti2Image(data.transpose(2, 1, 0), np.eye(4)), tmp_path / "n2.nii.gz")
    np.testing.assert_array_equal(read_nifti(tmp_path / "n2.nii.gz").data, data)
    noisy = np.random.default_rng(0).integers(0, 3000, (40, 40, 40)).astype(np.int16)
    write_nifti(tmp_path / "big.nii.gz", noisy, (1, 1, 1))
    cut = tmp_path / "cut.nii.gz"  # a truncated download: the header reads, the voxels end
    cut.write_bytes((tmp_path / "big.nii.gz").read_bytes()[:-2000])
    assert read_nifti_header(cut).shape == (40, 40, 40)
    with pytest.raises(InputError, match=r"cut\.nii\.gz.*complete gzip stream"):
        read_nifti(cut)


def test_nifti_reorients_an_lps_file_to_canonical(tmp_path):

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


PYDICOM_FILES = Path(get_testdata_file("CT_small.dcm")).parent
CT5N = PYDICOM_FILES / "dicomdirtests" / "98892001" / "CT5N"


def pydicom_data(name: str) -> Path:
    """A file of the pydicom-data wheel (module ``data_store``), found without importing it."""
    spec = importlib.util.find_spec("data_store")
    if spec is None:
        pytest.fail("pydicom-data is not installed: pip install -e '.[dev]'")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / name


def chest(spacing=(5.0, 0.7, 0.7)) -> np.ndarray:
    return ct_phantom((12, 48, 48), spacing, (), np.random.default_rng(0))


def test_nifti_with_header_only_scaling_gets_true_hu(tmp_path):
    """Case (b): raw values whose −1024 lives only in scl_inter; no CSV row."""
    hu = chest()
    write_nifti(tmp_path / "h.nii.gz", hu + 1024, (5.0, 0.7, 0.7), slope=1.0, intercept=-1024.0)
    vol = read_nifti(tmp_path / "h.nii.gz")
    assert vol.data.min() >= 0  # unscaled stored values: read as HU they were 1024 off
    out, decision = vol.to_hu()
    assert decision.source == "nifti_header"
    np.testing.assert_array_equal(out, hu)


def test_real_head_slice_padded_with_minus_3024():
    """693_UNCR (pydicom-data): PixelPaddingValue −2000 stored, −3024 HU outside the FOV."""
    vol = read_dicom_series(pydicom_data("693_UNCR.dcm"))
    assert vol.claims == {"dicom": Rescale(1.0, 0.0)} and vol.padding is not None
    assert vol.padding.mean() == pytest.approx(0.2128, abs=1e-3)
    assert np.all(vol.data[vol.padding] == -3024)
    out, decision = vol.to_hu()
    assert decision.source == "dicom" and decision.evidence["claims"]["dicom"]["verdict"] == "fits"
    assert out.min() == -1024 and np.all(out[vol.padding] == -1024)
    np.testing.assert_array_equal(out[~vol.padding], vol.data[~vol.padding])
    assert hu_plausibility(out, vol.padding)[0]


def test_real_padded_series_fills_padding_before_resampling(tmp_path):
    """Three 693_UNCR slices 5 mm apart: padding marked per slice, air after the rescale."""
    src = pydicom.dcmread(pydicom_data("693_UNCR.dcm"))
    z0 = float(src.ImagePositionPatient[2])
    for i in range(3):
        src.ImagePositionPatient = [*src.ImagePositionPatient[:2], z0 + 5 * i]
        src.SOPInstanceUID = f"{src.SOPInstanceUID}.{i}"
        src.save_as(tmp_path / f"s{i}", enforce_file_format=True)
    vol = read_dicom_series(tmp_path)
    assert vol.shape == (3, 512, 512) and vol.spacing[0] == pytest.approx(5.0)
    assert vol.padding.shape == vol.shape and vol.padding[2].mean() == pytest.approx(0.2128, 1e-3)
    out, decision = vol.to_hu()
    assert decision.source == "dicom"
    spacing = (vol.spacing[0], 0.75, 0.75)
    raw = ct.resample(vol.data, vol.spacing, spacing)  # −3024 interpolated into the edge
    filled = ct.resample(out, vol.spacing, spacing)
    assert raw.min() == -3024 and ((raw > -3024) & (raw < -1100)).sum() > 1000
    assert filled.min() >= -1024


@pytest.mark.parametrize(
    "syntax", ["JPEGLosslessProcess14_1", "JPEGLSLossless", "JPEG2000Lossless", "RLELossless"]
)
def test_compressed_series_read_as_their_uncompressed_slices(tmp_path, syntax):
    """Real 693_UNCR slices recompressed by GDCM into the lossless syntaxes PACS archives
    send: the same voxels and the same padding as uncompressed."""
    import gdcm

    src = pydicom.dcmread(pydicom_data("693_UNCR.dcm"))
    z0 = float(src.ImagePositionPatient[2])
    (tmp_path / "plain").mkdir()
    (tmp_path / syntax).mkdir()
    for i in range(3):
        src.ImagePositionPatient = [*src.ImagePositionPatient[:2], z0 + 5 * i]
        src.SOPInstanceUID = f"{src.SOPInstanceUID}.{i}"
        src.save_as(tmp_path / "plain" / f"s{i}", enforce_file_format=True)
        reader = gdcm.ImageReader()
        reader.SetFileName(str(tmp_path / "plain" / f"s{i}"))
        assert reader.Read()
        change = gdcm.ImageChangeTransferSyntax()
        change.SetTransferSyntax(gdcm.TransferSyntax(getattr(gdcm.TransferSyntax, syntax)))
        change.SetInput(reader.GetImage())
        assert change.Change()
        writer = gdcm.ImageWriter()
        writer.SetFileName(str(tmp_path / syntax / f"s{i}"))
        writer.SetFile(reader.GetFile())
        writer.SetImage(change.GetOutput())
        assert writer.Write()
    assert pydicom.dcmread(tmp_path / syntax / "s0").file_meta.TransferSyntaxUID.is_compressed
    plain, packed = read_dicom_series(tmp_path / "plain"), read_dicom_series(tmp_path / syntax)
    np.testing.assert_array_equal(packed.data, plain.data)
    np.testing.assert_array_equal(packed.padding, plain.padding)


def copy_series(src: Path, dst: Path, edit=None, suffix: str = "") -> list[Path]:
    """CT5N's slices copied (optionally edited per slice index) into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for i, f in enumerate(sorted(src.iterdir())):
        ds = pydicom.dcmread(f)
        if edit:
            edit(i, ds)
        ds.save_as(dst / f"{f.name}{suffix}", enforce_file_format=True)
        out.append(dst / f"{f.name}{suffix}")
    return out


def test_dicom_series_rescale_is_applied_per_slice(tmp_path):
    def shift(i, ds):  # slice 2 stores values 24 higher with an intercept 24 lower
        if i == 2:
            px = ds.pixel_array + 24
            ds.PixelData, ds.RescaleIntercept = px.astype(px.dtype).tobytes(), -1048

    copy_series(CT5N, tmp_path / "s", shift)
    np.testing.assert_array_equal(
        read_dicom_series(tmp_path / "s").data, read_dicom_series(CT5N).data
    )


def test_array_volumes_with_their_spacing(tmp_path):
    hu = chest()
    np.save(tmp_path / "raw.npy", (hu + 1024).astype(np.uint16))
    facts = {"spacing_zyx_mm": [5, 0.7, 0.7], "units": "raw", "slope": 1, "intercept": -1024}
    (tmp_path / "raw.json").write_text(json.dumps(facts))
    vol = read_array_volume(tmp_path / "raw.npy")
    out, decision = vol.to_hu()
    assert vol.spacing == (5.0, 0.7, 0.7) and decision.source == "sidecar"
    np.testing.assert_array_equal(out, hu)
    np.savez_compressed(tmp_path / "v.npz", image=hu, spacing_zyx_mm=np.array([5.0, 0.7, 0.7]))
    vol = read_array_volume(tmp_path / "v.npz")
    out, decision = vol.to_hu()
    assert (vol.claims, decision.source) == ({}, "data")  # no units: the data decides
    np.testing.assert_array_equal(out, hu)
    (tmp_path / "v.json").write_text('{"units": "hu", "spacing_zyx_mm": [5.0, 0.7, 0.7]}')
    assert read_array_volume(tmp_path / "v.npz").to_hu()[1].source == "sidecar"


def test_array_archives_as_other_tools_write_them(tmp_path):
    hu = chest()
    # float32 spacing in the archive, the same spacing in decimal in the sidecar: one claim.
    np.savez(tmp_path / "f.npz", image=hu, spacing_zyx_mm=np.array([5, 0.7, 0.7], np.float32))
    (tmp_path / "f.json").write_text('{"units": "hu", "spacing_zyx_mm": [5, 0.7, 0.7]}')
    assert read_array_volume(tmp_path / "f.npz").spacing == pytest.approx((5, 0.7, 0.7))
    # Members without the ".npy" suffix that np.savez adds (np.load reads them too).
    with zipfile.ZipFile(tmp_path / "bare.npz", "w") as z:
        for name, value in {"image": hu, "spacing_zyx_mm": np.array([5, 0.7, 0.7])}.items():
            with z.open(name, "w") as f:
                np.lib.format.write_array(f, value)
    np.testing.assert_array_equal(read_npz(tmp_path / "bare.npz", "image"), hu)
    # bzip2 members: refused for what they are, not as a false size claim.
    bz = zipfile.ZipFile(tmp_path / "bz.npz", "w", zipfile.ZIP_BZIP2)
    with bz, bz.open("a.npy", "w") as f:
        np.lib.format.write_array(f, hu)
    with pytest.raises(InputError, match=r"stored or deflated .* found zip compression method 12"):
        read_npz(tmp_path / "bz.npz")
    # A spacing given as a string is no spacing, even when its characters are digits.
    np.save(tmp_path / "s.npy", hu)
    (tmp_path / "s.json").write_text('{"spacing_zyx_mm": "577"}')
    with pytest.raises(InputError, match=r"s\.npy: expected spacing_zyx_mm: three positive"):
        read_array_volume(tmp_path / "s.npy")


def make_raw_tree(root: Path) -> None:
    """Every kind of CT item, two CT collisions, and colliding spike sequences and image sets."""
    hu = chest()
    for name in ("x y.nii.gz", "x_y.nii.gz", "scan.nii.gz"):
        (root / "nifti").mkdir(parents=True, exist_ok=True)
        write_nifti(root / "nifti" / name, hu, (5.0, 0.7, 0.7))
    copy_series(CT5N, root / "dicom" / "p1" / "CT5N")  # files without suffix, one series
    copy_series(CT5N, root / "dicom" / "p2", suffix=".dcm")

    def other_series(i, ds):
        ds.SeriesInstanceUID = "1.2.3"

    copy_series(CT5N, root / "dicom" / "p2", other_series, suffix="b.dcm")
    (root / "dicom" / "p2" / "broken.dcm").write_bytes(b"\0" * 128 + b"DICM" + b"\x02")
    (root / "dicom" / "p1" / "CT5N" / "README").write_text("not a slice")
    np.save(root / "nifti" / "vol.npy", hu)
    (root / "nifti" / "vol.json").write_text('{"spacing_zyx_mm": [5, 0.7, 0.7], "units": "hu"}')
    np.savez(root / "nifti" / "scan.npz", volume=hu, spacing_zyx_mm=np.array([5.0, 0.7, 0.7]))
    for dataset in ("spikes_a", "spikes_b"):
        seq = root / dataset / "train" / "GOPR01"
        (seq / "spike").mkdir(parents=True)
        (root / dataset / "dataset.json").write_text(json.dumps(
            {"height": 8, "width": 8, "layouts": {"spike": {"layout": "packed", "frames": 1}}}
        ))  # fmt: skip
        (seq / "sharp").mkdir()
        write_image(seq / "sharp" / "000000.png", np.zeros((8, 8, 3), np.uint8))
    for folder in ("img a", "img_a"):
        (root / folder).mkdir()
        write_image(root / folder / "0.png", np.zeros((4, 4), np.uint8))


def test_discovery_finds_every_ct_kind_and_isolates_collisions(tmp_path):
    make_raw_tree(tmp_path)
    found = discover_ct(tmp_path, family_tree(CT, tmp_path))
    kinds = {k: (item.kind, len(item.files)) for k, item in found.items.items()}
    assert kinds == {
        "dicom_p1_CT5N": ("dicom", 5),
        "dicom_p2_1.2.3": ("dicom", 5),
        f"dicom_p2_{pydicom.dcmread(next(CT5N.iterdir())).SeriesInstanceUID}": ("dicom", 5),
        "dicom_p2_broken.dcm": ("dicom", 1),
        "vol": ("npy", 2),  # the array and its sidecar: both are hashed for the data version
    }
    assert set(found.collisions) == {"x_y", "scan"}
    assert found.keys() == sorted([*kinds, "x_y", "scan"])
    with pytest.raises(InputError, match=r"nifti/x y\.nii\.gz.*key 'x_y'.*nifti/x_y\.nii\.gz"):
        found.get("x_y")
    with pytest.raises(InputError, match=r"scan\.nii\.gz.*scan\.npz"):
        found.get("scan")
    for key, item in found.items.items():  # every other item reads on its own
        if key == "dicom_p2_broken.dcm":
            with pytest.raises(InputError, match=r"broken\.dcm"):
                read_ct(item)
            continue
        vol = read_ct(item)
        assert vol.to_hu()[1].rescale == Rescale(1.0, 0.0), key


def test_a_series_beside_a_readme_and_a_dose_report_is_one_item(tmp_path):
    """Scanner exports put notes and a dose report (a structured report, no slice) beside the
    slices: neither hides the series, splits it in two, or becomes an item of its own."""
    folder = tmp_path / "p1" / "CT"
    slices = write_dicom_series(folder, np.zeros((3, 4, 4), np.int16), (2, 1, 1))
    (folder / "0README").write_text("exported by the PACS")
    report = pydicom.dcmread(slices[0])
    report.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.88.67"  # dose SR
    report.SOPClassUID, report.SeriesInstanceUID = "1.2.840.10008.5.1.4.1.1.88.67", "1.2.3.9"
    del report.PixelData
    report.save_as(folder / "dose.dcm", enforce_file_format=True)
    found = discover_ct(tmp_path)
    assert list(found.items) == ["p1_CT"] and not found.collisions
    assert sorted(found.items["p1_CT"].files) == sorted(slices)


def test_spike_and_image_collisions_are_reported_not_dropped(tmp_path):
    make_raw_tree(tmp_path)
    spikes = discover_spike_sequences(tmp_path)
    assert spikes.items == {} and list(spikes.collisions) == ["train_GOPR01"]
    assert [p.parts[-3] for p in spikes.collisions["train_GOPR01"]] == ["spikes_a", "spikes_b"]
    images = discover_image_sets(tmp_path, family_tree(IMAGES, tmp_path))  # no spike frames
    assert list(images.collisions) == ["img_a"] and "img_a" not in images.items
    with pytest.raises(InputError, match=r"img a.*img_a"):
        images.get("img_a")


def test_what_one_family_claims_no_other_family_discovers(tmp_path):
    """A spike dataset's frames and arrays are the spike family's: neither the image nor the
    CT discovery takes them.  The rule is the walk's, not the spike family's: any family's
    claim hides its folders from every other family, and from none without the claim."""
    from zarrfeed.families.registry import scan_raw
    from zarrfeed.families.spike import SPIKE

    seq = tmp_path / "spikes" / "train" / "GOPR01"
    (seq / "spike").mkdir(parents=True)
    (tmp_path / "spikes" / "dataset.json").write_text(json.dumps(
        {"height": 8, "width": 8, "layouts": {"spike": {"layout": "packed", "frames": 1}}}
    ))  # fmt: skip
    (seq / "spike" / "000000.dat").write_bytes(bytes(8))
    for kind in ("blur", "sharp"):
        (seq / kind).mkdir()
        write_image(seq / kind / "000000.png", np.zeros((8, 8, 3), np.uint8))
    np.save(seq / "flow.npy", np.zeros((2, 2, 2), np.int16))  # no CT volume
    (tmp_path / "photos").mkdir()
    write_image(tmp_path / "photos" / "0.png", np.zeros((4, 4), np.uint8))
    (tmp_path / "held").mkdir()
    np.save(tmp_path / "held" / "vol.npy", np.zeros((2, 2, 2), np.int16))
    assert sorted(scan_raw(CT, tmp_path)) == ["vol"]
    assert sorted(scan_raw(IMAGES, tmp_path)) == ["photos"]
    assert sorted(scan_raw(SPIKE, tmp_path)) == ["train_GOPR01"]
    unclaimed = discover_ct(tmp_path)  # the bare walk: every family's files
    assert sorted(unclaimed.items) == ["flow", "vol"]
    claimer = dataclasses.replace(
        IMAGES,
        name="claimer",
        raw=dataclasses.replace(IMAGES.raw, claims=lambda tree: [tmp_path / "held"]),
    )
    assert discover_ct(tmp_path, family_tree(CT, tmp_path, others=[claimer])).keys() == ["flow"]
    assert discover_ct(tmp_path, family_tree(CT, tmp_path, others=[])).keys() == ["flow", "vol"]


def test_discovery_opens_one_file_per_folder_outside_dicom(tmp_path, monkeypatch):
    """1,000 suffix-less non-DICOM files in 20 folders: three sniffs per folder (the first,
    middle and last file), nothing else."""
    for i in range(20):
        folder = tmp_path / f"frames{i}"
        folder.mkdir()
        for j in range(50):
            (folder / f"frame{j:04d}").write_bytes(b"\xff" * 200)
    copy_series(CT5N, tmp_path / "dicom")
    opened = []
    real_open = open
    monkeypatch.setattr(dicom_module, "open", lambda p, *a: opened.append(p) or real_open(p, *a),
                        raising=False)  # fmt: skip
    dicom_module._series_uid.cache_clear()
    found = discover_ct(tmp_path)
    assert list(found.items) == ["dicom"] and len(opened) == 20 * 3 + 1 + 5
    opened.clear()
    assert discover_ct(tmp_path).items == found.items and len(opened) == 20 * 3 + 1  # cached


def test_sample_sources_of_every_kind_decide_their_hu(tmp_path):
    """make_ct_sources: a padded raw DICOM series, an HU .npy, a header-scaled NIfTI."""
    written = list(make_ct_sources(tmp_path / "src", "small", np.random.default_rng(0)))
    assert len(written) == 40 + 2  # 40 slices, the .npy, the NIfTI
    found = discover_ct(tmp_path)
    assert {k: i.kind for k, i in found.items.items()} == {
        "src_dicom_patient_1_CT": "dicom", "volume_1": "npy", "scaled_1": "nifti",
    }  # fmt: skip
    sources = {}
    for key, item in found.items.items():
        vol = read_ct(item)
        out, decision = vol.to_hu()
        sources[key] = decision.source
        assert vol.spacing == pytest.approx((5.0, 3.6, 3.6)), key  # NIfTI stores float32
        assert hu_plausibility(out, vol.padding)[0], key
        assert out.min() >= -1024, key
        assert decision.evidence["data_says"] == ("raw" if key == "scaled_1" else "hu"), key
    assert sources == {"src_dicom_patient_1_CT": "dicom", "volume_1": "sidecar",
                       "scaled_1": "nifti_header"}  # fmt: skip
    padded = read_ct(found.items["src_dicom_patient_1_CT"])
    assert padded.padding is not None and np.all(padded.data[padded.padding] == -3024)


def test_tiff_channels_come_last_and_stacks_are_refused(tmp_path):
    """A planar (one plane per channel) RGB TIFF is (H, W, 3) like an interleaved one; a
    multi-page stack is no 2-D image and fails naming the file instead of becoming a
    (pages, H, W) "image" with W channels."""
    import tifffile

    rgb = np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8)
    planar = tmp_path / "planar.tif"
    tifffile.imwrite(planar, np.moveaxis(rgb, -1, 0), photometric="rgb", planarconfig="separate")
    np.testing.assert_array_equal(read_image(planar), rgb)
    stack = tmp_path / "stack.tif"
    tifffile.imwrite(stack, np.stack([rgb] * 4), photometric="rgb")
    with pytest.raises(InputError, match=r"stack\.tif.*one 2-D image.*\(4, 20, 30, 3\)"):
        read_image(stack)


def test_palette_and_bilevel_pngs_read_as_their_colours(tmp_path):
    """A palette PNG holds colour indices, a bilevel one bits: both come back as the pixels
    they show (RGB, grey, uint8), never as indices taken for grey levels or as booleans."""
    from PIL import Image

    rgb = np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)
    indexed = Image.fromarray(rgb).quantize(8)
    indexed.save(tmp_path / "p.png")
    np.testing.assert_array_equal(
        read_image(tmp_path / "p.png"), np.asarray(indexed.convert("RGB"))
    )
    levels = np.array([0, 40, 90, 255], dtype=np.uint8)
    indices = rgb[..., 0] % 4
    grey = Image.fromarray(indices, "P")
    grey.putpalette(np.repeat(levels, 3).tolist())  # grey levels as a palette
    grey.save(tmp_path / "grey_p.png")
    with Image.open(tmp_path / "grey_p.png") as stored:
        assert stored.mode == "P"
    np.testing.assert_array_equal(read_image(tmp_path / "grey_p.png"), levels[indices])
    Image.fromarray(rgb[..., 0] > 128).save(tmp_path / "b.png")
    got = read_image(tmp_path / "b.png")
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, np.where(rgb[..., 0] > 128, 255, 0))


def test_ct_rate_tables_saved_with_a_byte_order_mark_are_read(tmp_path):
    """Spreadsheet programs save "CSV UTF-8" with a byte order mark before the first column
    name: the tables are still found by their VolumeName column, and their text is UTF-8
    whatever the locale."""

    def table(name: str, header: str, row: str) -> None:
        (tmp_path / name).write_bytes(f"\ufeff{header}\n{row}\n".encode())

    table("train_metadata.csv", "VolumeName,RescaleSlope,RescaleIntercept", "a_1.nii.gz,1,-1024")
    table("train_labels.csv", "VolumeName,Emphysema", "a_1.nii.gz,1")
    table("train_reports.csv", "VolumeName,Findings_EN,Impressions_EN", "a_1.nii.gz,5 mm °,None")
    rows = ct_rate.read_ct_rate_metadata(tmp_path)
    assert rows["a_1"]["RescaleIntercept"] == "-1024"
    assert ct_rate.read_ct_rate_labels(tmp_path) == (["Emphysema"], {"a_1": [1]})
    assert ct_rate.read_ct_rate_reports(tmp_path) == {"a_1": "5 mm °\n\nNone"}


def test_deflated_series_reads_like_its_plain_slices(tmp_path):
    """Deflated Explicit VR Little Endian compresses the whole data set, pixel data
    included: its files are smaller than the pixels they hold, and the pixels decode
    through the inflated data set."""
    from pydicom.uid import DeflatedExplicitVRLittleEndian

    def deflate(i, ds):
        ds.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian

    files = copy_series(CT5N, tmp_path / "s", deflate)
    assert pydicom.dcmread(files[0]).file_meta.TransferSyntaxUID.is_deflated
    got = read_dicom_series(tmp_path / "s")
    np.testing.assert_array_equal(got.data, read_dicom_series(CT5N).data)


def test_scouts_and_dose_screens_beside_a_series_are_no_items(tmp_path):
    """CT exports put the scout (ImageType LOCALIZER, a projection in another orientation)
    and a dose screen (a Secondary Capture) beside the axial slices, in series of their own
    or in the slices' series: neither becomes an item, changes the series' key, or breaks
    the series."""
    folder = tmp_path / "p1" / "CT"
    slices = write_dicom_series(folder, np.zeros((3, 4, 4), np.int16), (2, 1, 1))
    for i, (name, series) in enumerate((("scout_own", "1.2.3.1"), ("scout_same", None))):
        scout = pydicom.dcmread(slices[0])
        scout.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]
        scout.ImageOrientationPatient = [1, 0, 0, 0, 0, -1]
        scout.SOPInstanceUID = scout.file_meta.MediaStorageSOPInstanceUID = f"1.2.3.4.{i}"
        scout.SeriesInstanceUID = series or scout.SeriesInstanceUID
        scout.save_as(folder / name, enforce_file_format=True)
    screen = pydicom.dcmread(slices[0])
    screen.file_meta.MediaStorageSOPClassUID = screen.SOPClassUID = "1.2.840.10008.5.1.4.1.1.7"
    screen.SeriesInstanceUID = "1.2.3.999"
    screen.SamplesPerPixel, screen.PhotometricInterpretation = 3, "RGB"
    screen.BitsAllocated, screen.BitsStored, screen.HighBit = 8, 8, 7
    screen.PlanarConfiguration, screen.PixelRepresentation = 0, 0
    screen.PixelData = bytes(4 * 4 * 3)
    screen.save_as(folder / "dose_screen", enforce_file_format=True)
    found = discover_ct(tmp_path)
    assert list(found.items) == ["p1_CT"] and not found.collisions
    assert sorted(found.items["p1_CT"].files) == sorted(slices)
    assert read_ct(found.items["p1_CT"]).shape == (3, 4, 4)
    uid = pydicom.dcmread(slices[0]).SeriesInstanceUID
    assert read_dicom_series(folder, series_uid=uid).shape == (3, 4, 4)  # the scout skipped


def test_upper_case_suffixes_are_found_and_read(tmp_path):
    """Files from systems that write names in capitals (``CT.NII.GZ``, ``VOL.NPZ``) are CT
    items like their lower-case twins, read by the reader of their kind."""
    hu = chest((5.0, 0.7, 0.7))[:4]
    write_nifti(tmp_path / "gz.nii.gz", hu, (5.0, 0.7, 0.7))
    (tmp_path / "gz.nii.gz").rename(tmp_path / "SCAN_A.NII.GZ")
    write_nifti(tmp_path / "plain.nii", hu, (5.0, 0.7, 0.7))
    (tmp_path / "plain.nii").rename(tmp_path / "SCAN_B.Nii")
    with open(tmp_path / "VOL.NPZ", "wb") as f:  # a path would get ".npz" appended
        np.savez(f, volume=hu, spacing_zyx_mm=np.array([5.0, 0.7, 0.7]))
    found = discover_ct(tmp_path)
    kinds = {key: item.kind for key, item in found.items.items()}
    assert kinds == {"SCAN_A": "nifti", "SCAN_B": "nifti", "VOL": "npz"}
    for item in found.items.values():
        np.testing.assert_array_equal(read_ct(item).data, hu)


@pytest.mark.parametrize(
    ("row", "found"),
    [("b_1.nii.gz,1", r"b_1\.nii\.gz: no value for B"), ("b_1.nii.gz,1,0.7", r"B = '0\.7'"),
     ("b_1.nii.gz,-1,0", r"A = '-1'")],
)  # fmt: skip
def test_label_rows_hold_a_0_or_1_in_every_column(tmp_path, row, found):
    """A short row, a probability or an "uncertain" -1 is no 0/1 label: the label CSV fails
    naming itself and the scan, instead of a TypeError, a probability truncated to 0, or a
    -1 that the uint8 label table cannot hold."""
    (tmp_path / "train_labels.csv").write_text(f"VolumeName,A,B\na_1.nii.gz,1,0\n{row}\n")
    with pytest.raises(InputError, match=rf"train_labels\.csv.*0/1 labels.*{found}"):
        ct_rate.read_ct_rate_labels(tmp_path)
