"""Preview images: views turned for radiological display with the right orientation letters,
through the body rather than a uniform middle slice, and large enough to read."""

import io

import numpy as np
import pytest
from PIL import Image

from zarrfeed.formats.previews import CELL, busiest_slice, oriented_views, volume_png


def marked_volume() -> np.ndarray:
    """(z, y, x) = (S, A, R) with one bright voxel block at the superior, anterior, right
    corner region (high indices on every axis)."""
    vol = np.zeros((20, 30, 40), np.float32)
    vol[15:19, 22:28, 30:38] = 1.0
    return vol


def bright_quadrant(image: np.ndarray) -> tuple[str, str]:
    rows, cols = np.nonzero(image)
    h, w = image.shape
    return ("top" if rows.mean() < h / 2 else "bottom"), (
        "left" if cols.mean() < w / 2 else "right"
    )


def test_views_follow_radiological_display_with_their_edge_letters():
    axial, coronal, sagittal = oriented_views(marked_volume(), "SAR", at=(17, 25, 34))
    assert axial.edges == ("A", "P", "R", "L") and bright_quadrant(axial.image) == ("top", "left")
    assert coronal.edges == ("S", "I", "R", "L")
    assert bright_quadrant(coronal.image) == ("top", "left")
    assert sagittal.edges == ("S", "I", "A", "P")
    assert bright_quadrant(sagittal.image) == ("top", "left")
    assert axial.image.shape == (30, 40) and sagittal.image.shape == (20, 30)
    # the same anatomy stored with x growing to the patient's left lands in the same place
    flipped = oriented_views(marked_volume()[:, :, ::-1], "SAL", at=(17, 25, 5))
    np.testing.assert_array_equal(flipped[0].image, axial.image)
    with pytest.raises(ValueError, match="one of R/L, A/P and S/I"):
        oriented_views(marked_volume(), "SAS")


def test_the_busiest_slice_avoids_a_uniform_middle():
    vol = np.zeros((8, 16, 64), np.float32)
    vol[:, :, 24:40] = 1.0  # a uniform block in the middle, like the mediastinum
    vol[:, ::3, 20] = 2.0  # stripes a little to the side, like lung vessels
    assert busiest_slice(vol, 2) == 20


def test_a_volume_preview_is_at_least_cell_sized_per_view():
    png = volume_png({"lung W1500 L-600": marked_volume()}, "title", (2.0, 1.0, 1.0))
    with Image.open(io.BytesIO(png)) as image:
        assert image.width >= 3 * CELL and image.height >= CELL
    assert CELL >= 256
