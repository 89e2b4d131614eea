"""Files stored as they are (issue 37): 16-bit colour kept, EXIF orientation applied and
recorded, symlinks read at their targets and recorded, every left-out entry listed."""

import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from zarrfeed.errors import InputError
from zarrfeed.families.images import read_set
from zarrfeed.formats import read_image, write_image
from zarrfeed.formats.images import image_orientation


def png16(path, image: np.ndarray) -> None:
    """A 16-bit PNG written independently of zarrfeed, each row through another of the five
    PNG filters (None, Sub, Up, Average, Paeth), so that reading it unfilters them all."""
    image = image[..., None] if image.ndim == 2 else image
    h, w, c = image.shape
    bpp = 2 * c
    raw = np.ascontiguousarray(image.astype(">u2")).view(np.uint8).reshape(h, w * bpp)
    raw = raw.astype(np.int32)
    rows, prev = [], np.zeros(w * bpp, np.int32)
    for y in range(h):
        cur = raw[y]
        left = np.concatenate([np.zeros(bpp, np.int32), cur[:-bpp]])
        upleft = np.concatenate([np.zeros(bpp, np.int32), prev[:-bpp]])
        kind = y % 5
        if kind == 0:
            out = cur
        elif kind == 1:
            out = cur - left
        elif kind == 2:
            out = cur - prev
        elif kind == 3:
            out = cur - (left + prev) // 2
        else:
            p = left + prev - upleft
            pa, pb, pc = abs(p - left), abs(p - prev), abs(p - upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
            out = cur - pred
        rows.append(bytes([kind]) + (out % 256).astype(np.uint8).tobytes())
        prev = cur

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    colour = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    header = struct.pack(">IIBBBBB", w, h, 16, colour, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"".join(rows)))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body + chunk(b"IEND", b""))


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
def test_16_bit_pngs_keep_every_bit(tmp_path, channels):
    """A 16-bit RGB (or RGBA, grey-alpha) PNG was read as uint8, its values shifted right
    by 8, without a word: every sample comes back exactly, as uint16."""
    rng = np.random.default_rng(channels)
    image = rng.integers(0, 65536, (37, 41, channels)).astype(np.uint16)
    image[0, 0] = 65535
    image[0, 1] = 257  # high byte 1, low byte 1: what a shift by 8 loses
    png16(tmp_path / "a.png", image)
    got = read_image(tmp_path / "a.png")
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got.reshape(image.shape), image)
    if channels > 1:  # zarrfeed's own writer (the sample data's) round-trips them too
        write_image(tmp_path / "w.png", image)
        np.testing.assert_array_equal(read_image(tmp_path / "w.png"), image)


def exif_jpeg(path, image: np.ndarray, orientation: int) -> None:
    im = Image.fromarray(image)
    exif = im.getexif()
    exif[0x0112] = orientation
    im.save(path, exif=exif.tobytes(), quality=100, subsampling=0)


def test_exif_orientation_is_applied_as_a_viewer_shows_it(tmp_path):
    """A phone's JPEG in its sensor's grid (192 rows × 256 columns) with orientation 6 is
    shown rotated 90° clockwise (256 × 192): read so, and the tag is told."""
    grid = np.zeros((192, 256, 3), np.uint8)
    grid[:32, :32] = (255, 0, 0)  # red in the file's top-left corner
    exif_jpeg(tmp_path / "phone.jpg", grid, 6)
    got = read_image(tmp_path / "phone.jpg")
    assert got.shape == (256, 192, 3)
    # Rotated clockwise, the file's top-left corner is the shown top-right one.
    assert got[8, -8, 0] > 200 and got[8, -8, 1:].max() < 60
    assert got[8, 8].max() < 60 and got[-8, -8].max() < 60
    assert image_orientation(tmp_path / "phone.jpg") == 6
    with Image.open(tmp_path / "phone.jpg") as im:
        np.testing.assert_array_equal(got, np.asarray(ImageOps.exif_transpose(im)))
    rng = np.random.default_rng(0)
    small = rng.integers(0, 255, (5, 7, 3)).astype(np.uint8)
    for tag in range(1, 9):  # every orientation as Pillow's own exif_transpose
        exif_jpeg(tmp_path / f"o{tag}.jpg", small, tag)
        with Image.open(tmp_path / f"o{tag}.jpg") as im:
            want = np.asarray(ImageOps.exif_transpose(im))
        np.testing.assert_array_equal(read_image(tmp_path / f"o{tag}.jpg"), want)
    write_image(tmp_path / "plain.png", small)
    assert image_orientation(tmp_path / "plain.png") is None


def test_a_set_mixing_8_and_16_bit_images_fails_naming_both(tmp_path):
    write_image(tmp_path / "a.png", np.full((8, 8, 3), 200, np.uint8))
    write_image(tmp_path / "b.png", np.full((8, 8, 3), 2000, np.uint16))
    with pytest.raises(InputError, match=r"b\.png.*uint8 \(8, 8, 3\) like a\.png.*uint16"):
        read_set([tmp_path / "a.png", tmp_path / "b.png"])


def test_a_hidden_file_is_listed_among_the_skipped_entries(tmp_path):
    """``..dots.nii.gz`` starts with '.': hidden by Unix convention, so left out, but no
    longer silently: every entry discovery leaves out is listed with its reason."""
    from zarrfeed.families.ct.discover import discover_ct
    from zarrfeed.formats import TreeCache, walk_tree, write_nifti

    volume = np.zeros((4, 8, 8), np.int16)
    write_nifti(tmp_path / "..dots.nii.gz", volume, (1.0, 1.0, 1.0))
    write_nifti(tmp_path / "seen.nii.gz", volume, (1.0, 1.0, 1.0))
    (tmp_path / ".cache").mkdir()
    cache = TreeCache(settled_ns=0)  # every mtime old enough to trust: listings are reused
    found = discover_ct(tmp_path, walk_tree(tmp_path, cache))
    assert found.keys() == ["seen"]
    assert found.skipped[str(tmp_path / "..dots.nii.gz")].startswith("hidden")
    assert "starts with '.'" in found.skipped[str(tmp_path / ".cache")]
    again = discover_ct(tmp_path, walk_tree(tmp_path, cache))  # from the cache: still reported
    assert again.skipped == found.skipped


def test_a_linked_scan_is_read_at_its_target_and_recorded(tmp_path, monkeypatch):
    """A file link to a scan outside the raw folder was followed and built with only the
    link in its provenance: the target and its own hash are recorded; under
    ZARRFEED_RAW_LINKS=inside discovery skips it and a build refuses it, naming both."""
    from zarrfeed.families.ct.discover import discover_ct, scan_ct
    from zarrfeed.formats import write_nifti
    from zarrfeed.sources.catalog import RawItem
    from zarrfeed.sources.raw import raw_origin, source_links
    from zarrfeed.store.provenance import file_sha256

    raw, elsewhere = tmp_path / "raw", tmp_path / "elsewhere"
    raw.mkdir(), elsewhere.mkdir()
    write_nifti(elsewhere / "scan.nii.gz", np.ones((4, 8, 8), np.int16), (1.0, 1.0, 1.0))
    write_nifti(raw / "inside.nii.gz", np.zeros((4, 8, 8), np.int16), (1.0, 1.0, 1.0))
    (raw / "link.nii.gz").symlink_to(elsewhere / "scan.nii.gz")
    (raw / "alias.nii.gz").symlink_to(raw / "inside.nii.gz")
    monkeypatch.delenv("ZARRFEED_RAW_LINKS", raising=False)
    scan = scan_ct(raw)
    assert {"link", "alias", "inside"} <= set(scan)
    links = source_links(scan["link"], [raw / "link.nii.gz"])
    target = str((elsewhere / "scan.nii.gz").resolve())
    assert links == {
        str(raw / "link.nii.gz"): {
            "target": target,
            "inside_root": False,
            "sha256": file_sha256(elsewhere / "scan.nii.gz"),
        }
    }
    assert source_links(scan["inside"], [raw / "inside.nii.gz"]) == {}

    monkeypatch.setenv("ZARRFEED_RAW_LINKS", "inside")
    found = discover_ct(raw)
    keys = found.keys()
    assert "link" not in keys and "alias" in keys  # a link inside the raw folder is fine
    why = found.skipped[str(raw / "link.nii.gz")]
    assert target in why and "outside the raw folder" in why
    item = RawItem("link", "nifti", str(raw / "link.nii.gz"), raw_origin(raw), 0, 0.0)
    with pytest.raises(InputError, match=r"link\.nii\.gz.*a link to .*elsewhere/scan\.nii\.gz"):
        source_links(item, [raw / "link.nii.gz"])
    monkeypatch.setenv("ZARRFEED_RAW_LINKS", "anything")
    with pytest.raises(ValueError, match="ZARRFEED_RAW_LINKS"):
        discover_ct(raw)
