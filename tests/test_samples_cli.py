import csv
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np

from zarrfeed.formats import read_dat, read_image, read_nifti
from zarrfeed.samples import CT_LABELS, METADATA_COLUMNS
from zarrfeed.transforms.hu import csv_rescale


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_cli_makes_all_families_identically_twice(tmp_path):
    for out in ("a", "b"):
        proc = subprocess.run(
            [sys.executable, "-m", "zarrfeed.cli", "sample-data", str(tmp_path / out)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
    a, b = digest(tmp_path / "a"), digest(tmp_path / "b")
    assert a == b and len(a) > 30
    assert {k.split("/")[0] for k in a} == {"ct-rate", "gopro-spike", "inspection"}


def test_ct_rate_layout_and_labels_are_true(sample_dir):
    d = sample_dir / "ct-rate" / "dataset"
    with open(d / "metadata" / "train_metadata.csv") as f:
        meta = list(csv.DictReader(f))
    assert tuple(meta[0]) == METADATA_COLUMNS and meta[0]["VolumeName"].endswith(".nii.gz")
    with open(d / "multi_abnormality_labels" / "train_predicted_labels.csv") as f:
        labels = list(csv.DictReader(f))
    assert tuple(labels[0])[1:] == CT_LABELS
    seen_hu = set()
    for row, lab in zip(meta, labels, strict=True):
        name = row["VolumeName"][: -len(".nii.gz")]
        split, patient, scan, _ = name.split("_")
        vol = read_nifti(
            d
            / f"{split}_fixed"
            / f"{split}_{patient}"
            / f"{split}_{patient}_{scan}"
            / row["VolumeName"]
        )
        assert vol.spacing[0] == float(row["ZSpacing"]) and vol.shape[0] == int(
            row["NumberofSlices"]
        )
        hu, decision = vol.to_hu(csv=csv_rescale(row))
        seen_hu.add(decision.intercept == 0)  # files store HU, or raw values the CSV rescales
        assert -1030 < hu.min() < -900  # air, whichever way the file stores it
        assert (lab["Medical material"] == "1") == bool((hu > 2500).any())
    assert seen_hu == {True, False}


def test_spike_layouts_agree_with_each_other(sample_dir):
    seq = next((sample_dir / "gopro-spike" / "train").iterdir())
    sharp = read_image(seq / "sharp" / "000000.png")
    h, w, _ = sharp.shape
    byte_layout = read_dat(seq / "spike" / "000000.dat", h, w, "bytes", frames=10)
    packed = read_dat(seq / "spike_packed" / "000000.dat", h, w, "packed")
    assert packed.shape == (40, h, w) and set(np.unique(byte_layout)) <= {0, 1}
    # Both streams encode the same scene: firing rates correlate with the blurred image.
    blur = read_image(seq / "blur" / "000000.png").astype(np.float32) @ [0.3, 0.59, 0.11]
    for s in (byte_layout, packed):
        assert np.corrcoef(s.mean(axis=0).ravel(), blur.ravel())[0, 1] > 0.5


def test_inspection_images(sample_dir):
    images = sorted((sample_dir / "inspection").rglob("*.png"))
    assert len(images) == 8
    assert read_image(images[0]).shape == (976, 176, 3)
