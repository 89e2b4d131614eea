"""A corpus of bad raw files, written to disk by each case: every one must end in an
InputError that names the file and what was expected, and no hostile header may make a
reader allocate more than the file could hold (measured with tracemalloc)."""

import gzip
import json
import re
import shutil
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file

from zarrfeed.errors import InputError
from zarrfeed.families.spike.discover import discover_spike_sequences
from zarrfeed.formats import (
    read_array_volume,
    read_dat,
    read_dicom_series,
    read_image,
    read_nifti,
    read_nifti_header,
    read_npz,
    write_image,
    write_nifti,
)

CT_SMALL = Path(get_testdata_file("CT_small.dcm"))
CT5N = CT_SMALL.parent / "dicomdirtests" / "98892001" / "CT5N"
MAX_PEAK = 32 << 20  # bytes a reader may allocate for any file in this corpus


def nifti_header(shape, dtype=np.int16) -> bytes:
    h = nib.Nifti1Header()
    h.set_data_shape(shape)
    h.set_data_dtype(dtype)
    h["vox_offset"] = 352
    return h.binaryblock + b"\0" * 4


def hostile_nifti(tmp: Path, name: str, shape, payload: int = 600) -> Path:
    body = nifti_header(shape) + np.random.default_rng(0).bytes(payload)
    (tmp / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    return tmp / name


def nifti_of(tmp: Path, name: str, data: np.ndarray, zooms=(1.0, 1.0, 1.0)) -> Path:
    img = nib.Nifti1Image(data, np.diag([*zooms, 1.0]))
    nib.save(img, tmp / name)
    return tmp / name


def truncated(src: Path, dst: Path, keep: int) -> Path:
    dst.write_bytes(src.read_bytes()[:keep])
    return dst


def series(tmp: Path, edit: Callable[[int, pydicom.Dataset], None]) -> Path:
    """CT5N copied with ``edit`` applied to each slice (index, dataset)."""
    out = tmp / "series"
    out.mkdir()
    for i, f in enumerate(sorted(CT5N.iterdir())):
        ds = pydicom.dcmread(f)
        edit(i, ds)
        ds.save_as(out / f"{i}.dcm", enforce_file_format=True)
    return out


def dicom_with(tmp: Path, name: str, **tags) -> Path:
    ds = pydicom.dcmread(CT_SMALL)
    for tag, value in tags.items():
        setattr(ds, tag, value)
    ds.save_as(tmp / name, enforce_file_format=True)
    return tmp / name


def npy_header(tmp: Path, name: str, shape, dtype="<f8", payload: int = 64) -> Path:
    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    with open(tmp / name, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(b"\0" * payload)
    return tmp / name


def with_sidecar(tmp: Path, name: str, array: np.ndarray, sidecar) -> Path:
    np.save(tmp / name, array)
    if sidecar is not None:
        text = sidecar if isinstance(sidecar, str) else json.dumps(sidecar)
        (tmp / name).with_suffix(".json").write_text(text)
    return tmp / name


def npz_bomb(tmp: Path) -> Path:
    """A zip member whose .npy header claims 20000² float64 (3.2 GB) over 64 bytes."""
    member = npy_header(tmp, "volume.npy", (20000, 20000))
    with zipfile.ZipFile(tmp / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.write(member, "volume.npy")
    return tmp / "bomb.npz"


def tiff_truncated(tmp: Path) -> Path:
    write_image(tmp / "full.tif", np.ones((300, 300), np.float32))
    return truncated(tmp / "full.tif", tmp / "cut.tif", 4000)


ARR = np.zeros((4, 8, 8), np.int16)
SPACING = {"spacing_zyx_mm": [1, 1, 1]}


def _resize(ds: pydicom.Dataset) -> None:
    px = ds.pixel_array[::2, ::2].copy()
    ds.Rows, ds.Columns, ds.PixelData = 8, 8, px.tobytes()


def _zero_pixdim(tmp: Path) -> Path:
    raw = bytearray(nifti_of(tmp, "z.nii", ARR).read_bytes())
    raw[84:88] = np.float32(0).tobytes()  # pixdim[2]: a voxel 0 mm wide
    (tmp / "z.nii").write_bytes(raw)
    return tmp / "z.nii"


def _pickled(tmp: Path) -> Path:
    np.save(tmp / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp / "o.json").write_text(json.dumps(SPACING))
    return tmp / "o.npy"


def _npz(tmp: Path, sidecar=None, **arrays) -> Path:
    np.savez(tmp / "v.npz", **arrays)
    if sidecar:
        (tmp / "v.json").write_text(json.dumps(sidecar))
    return tmp / "v.npz"


def _png_cut(tmp: Path) -> Path:
    write_image(tmp / "i.png", np.random.default_rng(0).integers(0, 255, (64, 64), np.uint8))
    return truncated(tmp / "i.png", tmp / "cut.png", 1500)


# (case id, builder(tmp) -> path, reader(path), regex the message must match after the path)
CASES = [
    # NIfTI: hostile headers, truncation, wrong magic, dimensions, values
    ("nifti 32767³ in .nii", lambda t: hostile_nifti(t, "h.nii", (32767,) * 3), read_nifti,
     r"70362301923678 bytes for a 32767×32767×32767 int16 volume.*found 952 bytes"),
    ("nifti 32767³ header only", lambda t: hostile_nifti(t, "h.nii", (32767,) * 3),
     read_nifti_header, r"bytes for a 32767×32767×32767"),
    ("nifti 1200³ in 1 KB .nii.gz", lambda t: hostile_nifti(t, "h.nii.gz", (1200,) * 3),
     read_nifti, r"3456000352 bytes.*found \d+ compressed bytes, which inflate to at most"),
    ("nifti .nii cut short", lambda t: truncated(nifti_of(t, "f.nii", np.ones((20, 20, 20),
     np.int16)), t / "cut.nii", 5000), read_nifti, r"16352 bytes for a 20×20×20 int16.*5000"),
    ("nifti .nii.gz cut short", lambda t: truncated(nifti_of(t, "f.nii.gz", np.random.default_rng(
     0).integers(0, 99, (30, 30, 30)).astype(np.int16)), t / "cut.nii.gz", 9000), read_nifti,
     r"complete gzip stream"),
    ("nifti empty", lambda t: truncated(CT_SMALL, t / "e.nii.gz", 0), read_nifti,
     r"a NIfTI-1/2 header"),
    ("nifti wrong magic", lambda t: (t / "m.nii").write_bytes(nifti_header((2, 2, 2)).replace(
     b"n+1", b"xyz") + b"\0" * 16) and t / "m.nii", read_nifti, r"(magic|NIfTI-1/2 header)"),
    ("nifti 4-D", lambda t: nifti_of(t, "4d.nii", np.zeros((4, 4, 4, 2), np.int16)), read_nifti,
     r"a 3-D volume, found shape \(4, 4, 4, 2\)"),
    ("nifti 2-D", lambda t: nifti_of(t, "2d.nii", np.zeros((4, 4), np.int16)), read_nifti,
     r"a 3-D volume, found shape \(4, 4\)"),
    ("nifti NaN voxels", lambda t: nifti_of(t, "nan.nii.gz", np.where(np.eye(8)[None] > 0,
     np.nan, 0).astype(np.float32).repeat(3, 0)), read_nifti, r"finite voxel values, found 24 "
     r"NaN/Inf of 192"),
    ("nifti all NaN", lambda t: nifti_of(t, "allnan.nii", np.full((4, 4, 4), np.nan, np.float32)),
     read_nifti, r"64 NaN/Inf of 64"),
    ("nifti Inf voxel", lambda t: nifti_of(t, "inf.nii", np.array([np.inf] + [0.0] * 7,
     np.float32).reshape(2, 2, 2)), read_nifti, r"1 NaN/Inf of 8"),
    ("nifti zero voxel size", _zero_pixdim, read_nifti, r"positive voxel sizes"),
    ("nifti complex voxels", lambda t: nifti_of(t, "c.nii", ARR.astype(np.complex64)),
     read_nifti, r"integer or float voxels"),
    # DICOM: pixel claims against PixelData, grids, positions, non-DICOM files
    ("dicom 65535² claim", lambda t: dicom_with(t, "big.dcm", Rows=65535, Columns=65535),
     read_dicom_series, r"8589672450 bytes for 65535×65535 pixels of 16 bits in PixelData, "
     r"found 32768"),
    ("dicom cut in pixel data", lambda t: truncated(CT_SMALL, t / "cut.dcm", 20000),
     read_dicom_series, r"39068 bytes for the PixelData it declares, found 20000"),
    ("dicom empty", lambda t: truncated(CT_SMALL, t / "e.dcm", 0), read_dicom_series,
     r"a DICOM file \('DICM' at byte 128\)"),
    ("dicom not DICOM", lambda t: (t / "n.dcm").write_text("hello") and t / "n.dcm",
     read_dicom_series, r"a DICOM file"),
    ("dicom mixed slice sizes", lambda t: series(t, lambda i, ds: i == 3 and _resize(ds)),
     read_dicom_series, r"3\.dcm: expected 16×16 pixels like .*0\.dcm, found 8×8"),
    ("dicom duplicate positions", lambda t: series(t, lambda i, ds: i == 4 and setattr(
     ds, "ImagePositionPatient", pydicom.dcmread(sorted(CT5N.iterdir())[1])
     .ImagePositionPatient)), read_dicom_series, r"one slice per position, found the position "
     r"of .*[14]\.dcm"),
    ("dicom missing position", lambda t: series(t, lambda i, ds: i == 2 and delattr(
     ds, "ImagePositionPatient")), read_dicom_series, r"2\.dcm: expected ImagePositionPatient"),
    ("dicom tilted slice", lambda t: series(t, lambda i, ds: i == 1 and setattr(
     ds, "ImageOrientationPatient", [1, 0, 0, 0, 0.8, 0.6])), read_dicom_series,
     r"1\.dcm: expected orientation"),
    ("dicom rescale on some slices", lambda t: series(t, lambda i, ds: i == 0 and delattr(
     ds, "RescaleSlope")), read_dicom_series, r"0\.dcm: expected RescaleSlope/RescaleIntercept "
     r"like the rest"),
    ("dicom multi-frame", lambda t: dicom_with(t, "mf.dcm", NumberOfFrames=2), read_dicom_series,
     r"single-frame CT slices, found 2 frames"),
    ("dicom no pixel spacing", lambda t: series(t, lambda i, ds: delattr(ds, "PixelSpacing")),
     read_dicom_series, r"PixelSpacing"),
    # .npy / .npz volumes: headers, pickles, spacing and sidecars
    ("npy 10⁵³ claim", lambda t: npy_header(t, "h.npy", (100000,) * 3), read_array_volume,
     r"8000000000000128 bytes for a \(100000, 100000, 100000\) float64 array, found 192"),
    ("npy empty", lambda t: truncated(CT_SMALL, t / "e.npy", 0), read_array_volume,
     r"a \.npy header"),
    ("npy wrong magic", lambda t: truncated(CT_SMALL, t / "m.npy", 400), read_array_volume,
     r"a \.npy header"),
    ("npy object array", lambda t: _pickled(t), read_array_volume,
     r"an array without Python objects"),
    ("npy no spacing", lambda t: with_sidecar(t, "v.npy", ARR, None), read_array_volume,
     r"v\.npy: expected a spacing: v\.json with \{\"spacing_zyx_mm\": \[z, y, x\]\}.*never "
     r"guessed"),
    ("npy 2-D", lambda t: with_sidecar(t, "v.npy", ARR[0], SPACING), read_array_volume,
     r"a 3-D \(z, y, x\) numeric array"),
    ("npy NaN", lambda t: with_sidecar(t, "v.npy", np.full((2, 2, 2), np.nan), SPACING),
     read_array_volume, r"8 NaN/Inf of 8"),
    ("sidecar not JSON", lambda t: with_sidecar(t, "v.npy", ARR, "{spacing"), read_array_volume,
     r"v\.json: expected a JSON object"),
    ("sidecar unknown field", lambda t: with_sidecar(t, "v.npy", ARR, {**SPACING, "unit": "hu"}),
     read_array_volume, r"v\.json: expected a JSON object.*\['unit'\]"),
    ("sidecar bad spacing", lambda t: with_sidecar(t, "v.npy", ARR, {"spacing_zyx_mm": [1, 0]}),
     read_array_volume, r"three positive numbers"),
    ("sidecar hu with intercept", lambda t: with_sidecar(t, "v.npy", ARR, {**SPACING,
     "units": "hu", "intercept": -1024}), read_array_volume, r'units "hu" alone'),
    ("npz without volume", lambda t: _npz(t, coords=ARR), read_array_volume,
     r"one array named volume or image or data, found \['coords'\]"),
    ("npz bomb member", npz_bomb, read_npz, r"3200000128 bytes for array 'volume'.*found 192"),
    ("npz spacing disagrees", lambda t: _npz(t, volume=ARR, spacing_zyx_mm=np.ones(3),
     sidecar={"spacing_zyx_mm": [2, 2, 2]}), read_array_volume,
     r"v\.json: expected spacing_zyx_mm = \[1\.0, 1\.0, 1\.0\] as in v\.npz"),
    # spike .dat and images
    ("dat cut short", lambda t: (t / "s.dat").write_bytes(b"\1" * 1000) and t / "s.dat",
     lambda p: read_dat(p, 40, 80), r"a whole number of 400-byte frames.*1000 bytes"),
    ("dat empty", lambda t: (t / "s.dat").write_bytes(b"") or t / "s.dat",
     lambda p: read_dat(p, 40, 80), r"found 0 bytes"),
    # a byte per pixel holding 0/255 (an image dump): counts of 255 would wrap in uint8 bins
    ("dat bytes not 0/1", lambda t: (t / "b.dat").write_bytes(b"\0\xff" * 3200) and t / "b.dat",
     lambda p: read_dat(p, 40, 80, "bytes", 2), r"b\.dat: expected spikes of 0 or 1.*255"),
    ("png cut short", lambda t: _png_cut(t), read_image, r"a PNG, JPEG or TIFF image"),
    ("png empty", lambda t: (t / "e.png").write_bytes(b"") or t / "e.png", read_image,
     r"a PNG, JPEG or TIFF image"),
    ("tiff cut short", tiff_truncated, read_image, r"360000 bytes for an uncompressed"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "build", "read", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_loudly_naming_the_file(tmp_path, case, build, read, message):
    path = build(tmp_path)
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=message) as err:
            read(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    named = Path(err.value.path)  # the file, its sidecar, or its series folder
    assert named.with_suffix("") == path.with_suffix("") or path in named.parents, named
    assert str(err.value).startswith(err.value.path)
    assert peak < MAX_PEAK, f"{case}: allocated {peak} bytes before failing"


def test_decompression_bombs_are_input_errors(tmp_path, monkeypatch):
    """Above Pillow's limit (a warning up to 2×, an error beyond) is an InputError either way."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for side in (40, 100):  # 1600 px: Pillow only warns; 10000 px: Pillow refuses
        write_image(tmp_path / f"{side}.png", np.zeros((side, side), np.uint8))
        with pytest.raises(InputError, match=rf"{side}\.png.*MAX_IMAGE_PIXELS"):
            read_image(tmp_path / f"{side}.png")
    write_image(tmp_path / "t.tif", np.zeros((40, 40), np.uint16))
    with pytest.raises(InputError, match=r"t\.tif.*at most 1000 pixels.*\(40, 40\)"):
        read_image(tmp_path / "t.tif")
    # Read side by side (a batched run's partitions), each file is judged on its own and the
    # process's warning filters are left alone.
    write_image(tmp_path / "ok.png", np.zeros((20, 20), np.uint8))
    filters = list(warnings.filters)

    def outcome(name: str) -> str:
        try:
            return str(read_image(tmp_path / name).shape)
        except InputError:
            return "refused"

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(outcome, ["40.png", "ok.png"] * 50))
    assert got == ["refused", "(20, 20)"] * 50
    assert warnings.filters == filters


def test_bad_spike_config_names_it(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "dataset.json").write_text('{"height": 0, "width": 8, "layouts": {}}')
    found = discover_spike_sequences(tmp_path)  # skipped and reported: discovery goes on
    (why,) = found.skipped.values()
    assert list(found.skipped) == [str(tmp_path / "d" / "dataset.json")]
    assert "height and width must be at least 1" in why


def test_a_good_file_next_to_bad_ones_still_reads(tmp_path):
    """The corpus does not make readers brittle: a normal scan of each kind reads."""
    write_nifti(tmp_path / "ok.nii.gz", np.zeros((4, 5, 6), np.int16), (1.0, 1.0, 1.0))
    assert read_nifti(tmp_path / "ok.nii.gz").shape == (4, 5, 6)
    shutil.copytree(CT5N, tmp_path / "ok_series")
    assert read_dicom_series(tmp_path / "ok_series").shape == (5, 16, 16)
    with_sidecar(tmp_path, "ok.npy", ARR, SPACING)
    assert read_array_volume(tmp_path / "ok.npy").spacing == (1.0, 1.0, 1.0)


@pytest.mark.parametrize(
    ("entry", "size", "message"),
    [
        ('{"layout": "bits", "frames": 10}', "8, 8", r"layout 'bits'.*'packed' or 'bytes'"),
        ('{"layout": "packed", "frames": 10}', "5, 5", r"5×5.*divisible by 8"),
        ('{"layout": "bytes", "frames": 0}', "8, 8", r"frames.*at least 1"),
    ],
)
def test_spike_config_layouts_are_checked_where_written(tmp_path, entry, size, message):
    """A layout no reader knows, packed frames that are no whole number of bytes or no
    frames at all fail discovery naming dataset.json, not each sequence's build later."""
    (tmp_path / "d" / "seq" / "spike").mkdir(parents=True)
    height, width = size.split(", ")
    config = f'{{"height": {height}, "width": {width}, "layouts": {{"spike": {entry}}}}}'
    (tmp_path / "d" / "dataset.json").write_text(config)
    found = discover_spike_sequences(tmp_path)
    assert not found.items
    assert list(found.skipped) == [str(tmp_path / "d" / "dataset.json")]
    assert re.search(message, found.skipped[str(tmp_path / "d" / "dataset.json")])


def test_a_malformed_metadata_row_skips_its_scan_not_the_discovery(tmp_path):
    """One CT-RATE metadata row with a rescale that is no number (or slope 0, or NaN) leaves
    its scan out, reported with the row's values, and every other scan is still found with
    its own CSV claim."""
    from zarrfeed.families.ct.discover import scan_ct

    for name in ("x_1", "y_1"):
        write_nifti(tmp_path / f"{name}.nii.gz", np.zeros((4, 5, 6), np.int16), (1.0, 1.0, 1.0))
    (tmp_path / "train_metadata.csv").write_text(
        "VolumeName,RescaleSlope,RescaleIntercept\nx_1.nii.gz,nan,-1024\ny_1.nii.gz,1,-1024\n"
    )
    scan = scan_ct(tmp_path)
    assert list(scan) == ["y_1"] and scan["y_1"].evidence == {"csv": [1.0, -1024.0]}
    why = scan.skipped[str(tmp_path / "x_1.nii.gz")]
    assert "RescaleSlope" in why and "'nan'" in why and "x_1.nii.gz" in why
