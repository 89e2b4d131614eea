"""Geometry the affine carries: oblique scans, and CT-CLIP's input on the stored voxel grid.

Every reference here is computed independently of zarrfeed: world coordinates through
nibabel's own affine and :func:`scipy.ndimage.map_coordinates` for the oblique scan, and
CT-CLIP's ``nii_img_to_tensor`` steps re-written with torch for the ``ct-clip`` preset.
"""

from dataclasses import replace

import nibabel as nib
import numpy as np
import pytest
import torch
from scipy.ndimage import map_coordinates

from zarrfeed.errors import InputError
from zarrfeed.families.ct import CTSettings, axis_aligned_hu
from zarrfeed.formats import ct_clip_input, read_nifti
from zarrfeed.transforms import ct, hu

RAW = hu.Rescale(1.0, -1024.0)  # the CT-RATE CSV's rescale: stored = HU + 1024


def chest(shape_xyz, rng):
    """An asymmetric phantom in HU on voxel axes (i, j, k): air, a body, an off-centre bone
    bar, a metal block (3000 HU) inside soft tissue, noise."""
    nx, ny, nz = shape_xyz
    i, j, k = np.meshgrid(*(np.arange(n) for n in shape_xyz), indexing="ij")
    out = np.full(shape_xyz, -1000.0)
    body = ((i - nx * 0.45) / (nx * 0.38)) ** 2 + ((j - ny * 0.5) / (ny * 0.3)) ** 2 < 1
    out[body] = 40.0
    out[body & (i > nx * 0.5) & (i < nx * 0.6) & (j < ny * 0.45)] = 700.0
    out[(i >= nx // 4) & (i < nx // 4 + 4) & (j >= ny // 2) & (j < ny // 2 + 3)
        & (k >= 2) & (k < nz // 2)] = 3000.0  # fmt: skip
    return out + rng.normal(0, 5, shape_xyz)


def write(path, hu_xyz, affine):
    img = nib.Nifti1Image(np.rint(hu_xyz + 1024).astype(np.int16), affine)
    img.header.set_xyzt_units("mm")
    nib.save(img, path)
    return path


def rotated_z(degrees, zooms, origin=(-20.0, -15.0, 30.0)):
    a = np.radians(degrees)
    rot = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
    affine = np.eye(4)
    affine[:3, :3] = rot @ np.diag(zooms)
    affine[:3, 3] = origin
    return affine


# --- (a) an oblique scan is resampled onto the axis-aligned grid --------------------------


def reference_oblique(path, target_zyx):
    """HU on the axis-aligned RAS grid of spacing ``target_zyx`` whose voxel 0 is the lowest
    corner of the bounding box of the scan's voxel centres (align_to_axes's contract),
    sampled through the file's own affine.  Returns (z, y, x) HU and the interior mask."""
    img = nib.load(path)
    stored = np.asarray(img.dataobj, dtype=np.float64) - 1024  # (i, j, k), HU
    affine = img.affine
    ends = [(0, n - 1) for n in stored.shape]
    corners = np.array([[a, b, c] for a in ends[0] for b in ends[1] for c in ends[2]])
    world = nib.affines.apply_affine(affine, corners)
    lo, hi = world.min(0), world.max(0)
    step = np.array(target_zyx[::-1])  # along R, A, S
    n = np.floor((hi - lo) / step + 1e-6).astype(int) + 1
    x, y, z = np.meshgrid(*(lo[a] + step[a] * np.arange(n[a]) for a in range(3)), indexing="ij")
    points = np.stack([x, y, z], -1).reshape(-1, 3)
    ijk = nib.affines.apply_affine(np.linalg.inv(affine), points).T
    values = map_coordinates(stored, ijk, order=1, mode="constant", cval=-1024.0)
    inside = np.all((ijk >= 0) & (ijk <= np.array(stored.shape)[:, None] - 1), axis=0)
    shape = tuple(n)
    return (
        values.reshape(shape).transpose(2, 1, 0),
        inside.reshape(shape).transpose(2, 1, 0),
    )


def test_a_scan_rotated_30_degrees_is_resampled_through_its_affine(tmp_path):
    rng = np.random.default_rng(0)
    zooms, target = (1.0, 1.2, 2.5), (2.5, 1.0, 1.0)
    phantom = chest((40, 34, 10), rng)
    oblique = write(tmp_path / "oblique.nii.gz", phantom, rotated_z(30, zooms))
    straight = write(tmp_path / "straight.nii.gz", phantom, rotated_z(0, zooms))

    got, spacing, decision, geometry = axis_aligned_hu(read_nifti(oblique), target, csv=RAW)
    assert (decision.slope, decision.intercept) == (1.0, -1024.0)
    assert spacing == target
    assert geometry["resampled"] and geometry["off_axis_deg"] == pytest.approx(30, abs=1e-3)
    np.testing.assert_allclose(geometry["affine_ras"], nib.load(oblique).affine, atol=1e-5)

    expected, inside = reference_oblique(oblique, target)
    assert got.shape == expected.shape and got.dtype == np.float32
    assert inside.mean() > 0.5
    assert np.abs(got - expected)[inside].max() <= 1.0
    assert np.all(got[~inside] <= expected[~inside].max())  # outside: air
    assert got[0, 0, 0] == -1024.0  # a bounding-box corner no voxel reaches
    # What the store holds (int16 at the configured spacing) still agrees within 1 HU.
    stored = ct.preprocess(got, spacing, replace(ct.HU_ISOTROPIC, spacing=target))
    assert np.abs(stored - expected)[inside].max() <= 1.0

    # The bug: the rotation dropped gives the axis-aligned copy's HU, far from the truth.
    flat, _, _, flat_geometry = axis_aligned_hu(read_nifti(straight), target, csv=RAW)
    assert not flat_geometry["resampled"] and flat_geometry["off_axis_deg"] == 0
    assert flat.shape != got.shape or np.abs(flat - got).max() > 500


def test_an_oblique_scan_is_refused_by_setting_naming_file_and_angle(tmp_path):
    phantom = chest((20, 18, 6), np.random.default_rng(1))
    path = write(tmp_path / "tilted_scan.nii.gz", phantom, rotated_z(30, (1.0, 1.0, 2.0)))
    assert CTSettings().oblique == "resample"
    refuse = CTSettings(oblique="refuse").oblique
    with pytest.raises(InputError, match=r"tilted_scan\.nii\.gz.*30\.00°"):
        axis_aligned_hu(read_nifti(path), (2.0, 1.0, 1.0), refuse, csv=RAW)
    with pytest.raises(ValueError):
        CTSettings(oblique="ignore")


def test_rounding_in_the_header_is_not_an_oblique_scan(tmp_path):
    """A rotation inside the tolerance (float32 quaternions) keeps the old, exact path."""
    phantom = chest((20, 18, 6), np.random.default_rng(2))
    path = write(tmp_path / "almost.nii.gz", phantom, rotated_z(0.02, (1.0, 1.0, 2.0)))
    vol = read_nifti(path)
    got, spacing, _, geometry = axis_aligned_hu(vol, (2.0, 1.0, 1.0), "refuse", csv=RAW)
    assert not geometry["resampled"] and spacing == vol.spacing
    np.testing.assert_array_equal(got, vol.to_hu(csv=RAW)[0])


def test_the_oblique_setting_enters_the_hu_fingerprint():
    from zarrfeed.families.ct import CT, CT_HU

    before = CT.values({})
    after = CT.values({"oblique": "refuse"})
    assert CT_HU.code_version(after) != CT_HU.code_version(before)


# --- (b) the ct-clip preset is CT-CLIP's input tensor -------------------------------------


def ct_clip_reference(path, slope, intercept, target_hwd=(480, 480, 240)):
    """CT-CLIP's ``nii_img_to_tensor`` (scripts/data_inference_nii.py), step by step:
    get_fdata (X, Y, Z) → CSV rescale → clip [-1000, 1000] → (Z, X, Y) → trilinear to
    1.5 × 0.75 × 0.75 mm, size int(n · current / target) → (X, Y, Z) → /1000 → centre crop,
    symmetric pad with -1 → (Z, X, Y).  The spacing is (z, xy, xy) as in the CSV."""
    img = nib.load(path)
    data = img.get_fdata() * slope + intercept
    data = np.clip(data, -1000, 1000).transpose(2, 0, 1)
    zooms = img.header.get_zooms()
    current, target = (zooms[2], zooms[0], zooms[0]), (1.5, 0.75, 0.75)
    size = [int(n * c / t) for n, c, t in zip(data.shape, current, target, strict=True)]
    t = torch.nn.functional.interpolate(
        torch.tensor(data)[None, None], size=size, mode="trilinear", align_corners=False
    )
    t = torch.tensor((t[0, 0].numpy().transpose(1, 2, 0) / 1000).astype(np.float32))
    starts = [max((n - m) // 2, 0) for n, m in zip(t.shape, target_hwd, strict=True)]
    ends = [min(s + m, n) for s, m, n in zip(starts, target_hwd, t.shape, strict=True)]
    t = t[tuple(slice(s, e) for s, e in zip(starts, ends, strict=True))]
    pads = []
    for n, m in zip(t.shape, target_hwd, strict=True):
        before = (m - n) // 2
        pads = [before, m - n - before, *pads]  # F.pad lists the last axis first
    t = torch.nn.functional.pad(t, pads, value=-1)
    return t.permute(2, 0, 1).numpy()


AFFINES = {
    "lps": np.diag([-0.9, -0.9, 3.0, 1.0]),
    "flipped_k": np.diag([0.9, 0.9, -3.0, 1.0]),
    "permuted": np.array([[0, -0.9, 0, 10], [0.9, 0, 0, -5], [0, 0, 3.0, 2], [0, 0, 0, 1.0]]),
}


@pytest.mark.parametrize("orientation", sorted(AFFINES))
def test_ct_clip_preset_is_ct_clips_tensor(tmp_path, orientation):
    phantom = chest((64, 54, 20), np.random.default_rng(3))  # i, j, k; metal at 3000 HU
    path = write(tmp_path / f"{orientation}.nii.gz", phantom, AFFINES[orientation])
    expected = ct_clip_reference(path, 1.0, -1024.0)
    got = ct_clip_input(path, csv=RAW)
    assert got.shape == expected.shape == (240, 480, 480) and got.dtype == np.float32
    assert np.abs(got - expected).max() <= 1e-3
    assert (got == -1).mean() > 0.9  # padded: the phantom is small

    # Each difference the preset had before moves voxels by more than the tolerance (shown
    # uncropped: the resampled extent is 76 × 64 × 40).
    whole = ct_clip_reference(path, 1.0, -1024.0, (76, 64, 40))
    vol = read_nifti(path, canonical=False)
    data = vol.to_hu(csv=RAW)[0]
    uncropped = replace(ct.CT_CLIP, shape=None)
    assert np.abs(ct.preprocess(data, vol.spacing, uncropped) - whole).max() <= 1e-3
    old_order = replace(uncropped, clip_first=False)
    assert np.abs(ct.preprocess(data, vol.spacing, old_order) - whole).max() > 0.05
    zyx = ct.preprocess(data, vol.spacing, replace(uncropped, axes="zyx"))
    assert zyx.shape == (40, 64, 76) != whole.shape  # the in-plane axes transposed
    # Reoriented to RAS first (the store's convention): flipped or transposed.
    ras = read_nifti(path)
    canonical = ct.preprocess(ras.to_hu(csv=RAW)[0], ras.spacing, uncropped)
    assert canonical.shape != whole.shape or np.abs(canonical - whole).max() > 0.5


def test_ct_clip_crops_like_ct_clip(tmp_path):
    """A target smaller than the resampled scan on some axes: the centre crop (and the pad
    on the others) fall where CT-CLIP's do."""
    phantom = chest((64, 54, 20), np.random.default_rng(4))
    path = write(tmp_path / "crop.nii.gz", phantom, AFFINES["lps"])
    hwd = (50, 90, 24)  # x: 76 → 50 cropped, y: 64 → 90 padded, z: 40 → 24 cropped
    expected = ct_clip_reference(path, 1.0, -1024.0, hwd)
    vol = read_nifti(path, canonical=False)
    preset = replace(ct.CT_CLIP, shape=(hwd[2], hwd[0], hwd[1]))
    got = ct.preprocess(vol.to_hu(csv=RAW)[0], vol.spacing, preset)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-3


def test_inspect_shows_a_partitions_geometry(tmp_path):
    from zarrfeed.commands.inspect import partition
    from zarrfeed.families.ct import CT_HU
    from zarrfeed.store import ZarrStore

    store = ZarrStore(tmp_path / "s.zarr")
    geometry = {"off_axis_deg": 30.0, "resampled": True, "affine_ras": np.eye(4).tolist()}
    with store.write_partition(CT_HU.path, "k", {"geometry": geometry}) as w:
        w.write("hu", np.zeros((2, 3, 4), dtype=np.int16))
    assert partition(store, CT_HU, "k")["provenance"]["geometry"] == geometry
