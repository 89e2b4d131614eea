"""Deterministic synthetic sample data for all three families, laid out like the real datasets.

* ``ct-rate/dataset/...``: chest-CT phantoms in the CT-RATE folder nesting, with the metadata,
  18-label and report CSVs (same columns).  Labels are true of the phantom: a scan labelled
  "Lung nodule" contains nodules.  Half the volumes store raw values (HU + 1024, slope 1,
  intercept −1024 in the metadata CSV), half store HU directly, like some ``*_fixed`` exports.
* ``gopro-spike/{train,test}/GOPR…/``: sharp frames of a panning textured scene, blur = mean
  of the sub-frames, spikes from the integrate-and-fire simulator in both ``.dat`` layouts
  (``spike/``: 10 frames, one byte per pixel; ``spike_packed/``: bit-packed camera frames).
* ``inspection/{train,test}/``: 976×176×3 stripe images (target + two reference channels).

:func:`make_ct_sources` writes CT in the other raw forms (a DICOM series, an ``.npy`` volume
with its sidecar, a NIfTI scaled in its header); :func:`make_sample_data` leaves it out, so
its output is unchanged.

Everything derives from one seed; running twice gives byte-identical files.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from zarrfeed.formats.dicom import write_dicom_series
from zarrfeed.formats.images import write_image
from zarrfeed.formats.nifti import write_nifti
from zarrfeed.formats.spike import write_dat
from zarrfeed.transforms.spike import simulate_spikes, to_gray

CT_LABELS = (
    "Medical material", "Arterial wall calcification", "Cardiomegaly", "Pericardial effusion",
    "Coronary artery wall calcification", "Hiatal hernia", "Lymphadenopathy", "Emphysema",
    "Atelectasis", "Lung nodule", "Lung opacity", "Pulmonary fibrotic sequela", "Pleural effusion",
    "Mosaic attenuation pattern", "Peribronchial thickening", "Consolidation", "Bronchiectasis",
    "Interlobular septal thickening",
)  # fmt: skip
# Findings the phantom can draw; the other labels stay 0.
RENDERED = ("Medical material", "Arterial wall calcification", "Cardiomegaly", "Emphysema",
            "Lung nodule", "Lung opacity", "Pleural effusion", "Consolidation")  # fmt: skip
METADATA_COLUMNS = (
    "VolumeName", "Manufacturer", "SeriesDescription", "ManufacturerModelName", "PatientSex",
    "PatientAge", "ReconstructionDiameter", "DistanceSourceToDetector", "DistanceSourceToPatient",
    "GantryDetectorTilt", "TableHeight", "RotationDirection", "ExposureTime", "XRayTubeCurrent",
    "Exposure", "FilterType", "GeneratorPower", "FocalSpots", "ConvolutionKernel",
    "PatientPosition", "RevolutionTime", "SingleCollimationWidth", "TotalCollimationWidth",
    "TableSpeed", "TableFeedPerRotation", "SpiralPitchFactor", "DataCollectionCenterPatient",
    "ReconstructionTargetCenterPatient", "ExposureModulationType", "CTDIvol",
    "ImagePositionPatient", "ImageOrientationPatient", "SliceLocation", "SamplesPerPixel",
    "PhotometricInterpretation", "Rows", "Columns", "XYSpacing", "RescaleIntercept",
    "RescaleSlope", "RescaleType", "NumberofSlices", "ZSpacing", "StudyDate",
)  # fmt: skip
REPORT_COLUMNS = ("VolumeName", "ClinicalInformation_EN", "Technique_EN", "Findings_EN",
                  "Impressions_EN")  # fmt: skip

# (slices, rows, columns) and (z, y, x) spacing in mm.  "full" is a CT-RATE-sized scan.
CT_SIZES = {
    "small": ((40, 96, 96), (5.0, 3.6, 3.6)),
    "full": ((300, 512, 512), (1.0, 0.68, 0.68)),
}
SPIKE_SIZES = {"small": (96, 160), "full": (396, 640)}
SPIKE_SUBFRAMES = 10  # high-speed frames per sample: blur = their mean (the GoPro spike layout)
SPIKE_PACKED_REPEAT = 4  # camera frames per sub-frame in the bit-packed stream
INSPECTION_SHAPE = (976, 176, 3)


@dataclass(frozen=True)
class ScanSpec:
    name: str  # e.g. train_1_a_1
    split: str  # train | valid
    stores_hu: bool
    findings: tuple[str, ...]


def _smooth_noise(shape: tuple[int, ...], rng: np.random.Generator, coarse: int = 8) -> np.ndarray:
    """Smooth random field in [-1, 1] (coarse Gaussian noise, trilinear/bilinear upsampled)."""
    small = tuple(max(2, n // coarse) for n in shape)
    t = torch.from_numpy(rng.standard_normal(small).astype(np.float32))[None, None]
    mode = "trilinear" if len(shape) == 3 else "bilinear"
    up = F.interpolate(t, size=shape, mode=mode, align_corners=False)[0, 0].numpy()
    return up / max(float(np.abs(up).max()), 1e-6)


def ct_phantom(
    shape: tuple[int, int, int],
    spacing: tuple[float, float, float],
    findings: tuple[str, ...],
    rng: np.random.Generator,
) -> np.ndarray:
    """A chest-CT phantom in HU (int16, z y x): body, lungs with vessels, heart, aorta, spine,
    ribs, and the requested findings drawn where a radiologist would look for them."""
    nz, ny, nx = shape
    z, y, x = np.meshgrid(
        np.linspace(-1, 1, nz, dtype=np.float32),
        np.linspace(-1, 1, ny, dtype=np.float32),
        np.linspace(-1, 1, nx, dtype=np.float32),
        indexing="ij",
    )
    hu = np.full(shape, -1000, dtype=np.float32)
    body = (x / 0.86) ** 2 + (y / 0.62) ** 2 <= 1
    hu[body] = -80  # subcutaneous fat
    inner = (x / 0.78) ** 2 + (y / 0.54) ** 2 <= 1
    hu[inner] = 40  # muscle / mediastinum
    lung = np.zeros(shape, dtype=bool)
    for side in (-1, 1):
        lung |= ((x - side * 0.38) / 0.3) ** 2 + ((y + 0.02) / 0.4) ** 2 + (z / 1.15) ** 2 <= 1
    hu[lung] = -860
    vessels = lung & (np.abs(_smooth_noise(shape, rng, coarse=6)) < 0.05)
    hu[vessels] = 35
    heart_r = 0.3 if "Cardiomegaly" in findings else 0.2
    heart = (x / heart_r) ** 2 + ((y + 0.12) / (heart_r * 0.9)) ** 2 + ((z + 0.3) / 0.6) ** 2 <= 1
    hu[heart] = 45
    aorta = (x - 0.08) ** 2 + (y - 0.22) ** 2 <= 0.07**2
    hu[aorta] = 50
    if "Arterial wall calcification" in findings:
        hu[aorta & ((x - 0.08) ** 2 + (y - 0.22) ** 2 >= 0.055**2) & (np.sin(9 * z) > 0.3)] = 600
    spine = x**2 + (y - 0.42) ** 2 <= 0.1**2
    hu[spine] = 250
    hu[spine & (x**2 + (y - 0.42) ** 2 >= 0.075**2)] = 900
    r = np.sqrt((x / 0.8) ** 2 + (y / 0.56) ** 2)
    ribs = (r > 0.93) & (r < 1.0) & (np.sin(z * nz * spacing[0] / 12.0) > 0.55) & (y > -0.3)
    hu[ribs] = 700
    if "Emphysema" in findings:
        hu[lung & (_smooth_noise(shape, rng, coarse=4) > 0.45)] = -975
    if "Lung opacity" in findings:
        hu[lung & (_smooth_noise(shape, rng, coarse=3) > 0.55)] = -550
    if "Consolidation" in findings:
        hu[lung & (z > 0.5) & (x > 0.2) & (y < 0.1)] = 25
    if "Pleural effusion" in findings:
        hu[lung & (y > 0.22)] = 12
    if "Lung nodule" in findings:
        lz, ly, lx = np.nonzero(lung & ~vessels)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, len(lz)))
            radius_mm = float(rng.uniform(4, 9))
            d2 = sum(
                ((c - c0) * s) ** 2
                for c, c0, s in zip(
                    np.ogrid[:nz, :ny, :nx], (lz[i], ly[i], lx[i]), spacing, strict=True
                )
            )
            hu[d2 <= radius_mm**2] = 30
    if "Medical material" in findings:
        hu[(x + 0.15) ** 2 + (y + 0.35) ** 2 + (z - 0.5) ** 2 <= 0.05**2] = 3000
    hu[body] += rng.normal(0, 12, size=int(body.sum())).astype(np.float32)
    return np.clip(np.rint(hu), -1024, 3071).astype(np.int16)


def ct_scan_specs(count: int, rng: np.random.Generator) -> list[ScanSpec]:
    """CT-RATE naming: about a quarter valid; every second patient has a second reconstruction.

    Each scan draws each rendered finding with probability 0.35, except that every second
    valid scan has exactly the findings the valid scan before it lacks: with two or more
    valid scans, each rendered finding is present in one and absent in another, so a
    classifier scored on the valid scans alone (held out of training) has a defined AUROC
    for every finding the phantom draws."""
    n_valid = max(1, count // 4) if count > 1 else 0
    specs, patient = [], {"train": 0, "valid": 0}
    for i in range(count):
        split = "valid" if i >= count - n_valid else "train"
        reuse = specs and specs[-1].split == split and specs[-1].name.endswith("_1") and i % 3 == 1
        if reuse:
            name = specs[-1].name[:-2] + "_2"
        else:
            patient[split] += 1
            name = f"{split}_{patient[split]}_a_1"
        findings = tuple(f for f in RENDERED if rng.random() < 0.35)
        valid_index = i - (count - n_valid)
        if split == "valid" and valid_index % 2 == 1:
            findings = tuple(f for f in RENDERED if f not in specs[-1].findings)
        specs.append(ScanSpec(name, split, stores_hu=bool(i % 2), findings=findings))
    return specs


def ct_rate_path(name: str) -> str:
    """Repository path of a CT-RATE volume: ``dataset/train_fixed/train_1/train_1_a/...``."""
    split, patient, scan, _ = name.split("_")
    folder = f"{split}_{patient}"
    return f"dataset/{split}_fixed/{folder}/{folder}_{scan}/{name}.nii.gz"


def _metadata_row(spec: ScanSpec, shape, spacing, rng: np.random.Generator) -> dict[str, str]:
    nz, ny, nx = shape
    row = dict.fromkeys(METADATA_COLUMNS, "")
    row.update(
        {
            "VolumeName": f"{spec.name}.nii.gz",
            "Manufacturer": "SIEMENS",
            "SeriesDescription": "Thorax",
            "ManufacturerModelName": "SOMATOM go.Now",
            "PatientSex": "MF"[int(rng.integers(0, 2))],
            "PatientAge": f"{int(rng.integers(30, 85)):03d}Y",
            "ReconstructionDiameter": f"{nx * spacing[2]:.0f}",
            "GantryDetectorTilt": "0",
            "ConvolutionKernel": "Br40",
            "PatientPosition": "HFS",
            "ImagePositionPatient": f"[{-nx * spacing[2] / 2:.1f}, {-ny * spacing[1] / 2:.1f}, 0]",
            "ImageOrientationPatient": "[1, 0, 0, 0, 1, 0]",
            "SamplesPerPixel": "1",
            "PhotometricInterpretation": "MONOCHROME2",
            "Rows": str(ny),
            "Columns": str(nx),
            "XYSpacing": f"[{spacing[1]}, {spacing[2]}]",
            "RescaleIntercept": "-1024",
            "RescaleSlope": "1",
            "RescaleType": "HU",
            "NumberofSlices": str(nz),
            "ZSpacing": str(spacing[0]),
            "StudyDate": f"2021{int(rng.integers(1, 13)):02d}{int(rng.integers(1, 29)):02d}",
        }
    )
    return row


def _report(spec: ScanSpec) -> dict[str, str]:
    found = [f.lower() for f in spec.findings]
    findings = "Findings: " + ("; ".join(found) + "." if found else "no acute abnormality.")
    impression = ", ".join(found).capitalize() + "." if found else "Normal chest CT."
    return {"VolumeName": f"{spec.name}.nii.gz", "ClinicalInformation_EN": "Not given.",
            "Technique_EN": "Non-contrast chest CT (synthetic phantom).",
            "Findings_EN": findings, "Impressions_EN": impression}  # fmt: skip


def _write_csv(path: Path, columns, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def make_ct_rate(out: Path, count: int, size: str, rng: np.random.Generator) -> Iterator[Path]:
    shape, spacing = CT_SIZES[size]
    specs = ct_scan_specs(count, rng)
    meta: dict[str, list] = {"train": [], "valid": []}
    labels: dict[str, list] = {"train": [], "valid": []}
    reports: dict[str, list] = {"train": [], "valid": []}
    for spec in specs:
        hu = ct_phantom(shape, spacing, spec.findings, rng)
        path = out / ct_rate_path(spec.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_nifti(path, hu if spec.stores_hu else (hu.astype(np.int16) + 1024), spacing)
        meta[spec.split].append(_metadata_row(spec, shape, spacing, rng))
        labels[spec.split].append(
            {"VolumeName": f"{spec.name}.nii.gz", **{k: int(k in spec.findings) for k in CT_LABELS}}
        )
        reports[spec.split].append(_report(spec))
        yield path
    d = out / "dataset"
    for split, long in (("train", "train"), ("valid", "validation")):
        _write_csv(d / "metadata" / f"{long}_metadata.csv", METADATA_COLUMNS, meta[split])
        _write_csv(
            d / "multi_abnormality_labels" / f"{split}_predicted_labels.csv",
            ("VolumeName", *CT_LABELS),
            labels[split],
        )
        _write_csv(
            d / "radiology_text_reports" / f"{long}_reports.csv", REPORT_COLUMNS, reports[split]
        )


def make_ct_sources(out: Path, size: str, rng: np.random.Generator) -> Iterator[Path]:
    """One phantom scan in each other raw form zarrfeed reads: a DICOM series (raw values,
    intercept −1024, −2000 padding outside the circular field of view), an HU ``.npy``
    volume with its sidecar, and a raw NIfTI whose −1024 lives only in its header."""
    shape, spacing = CT_SIZES[size]
    y, x = np.ogrid[: shape[1], : shape[2]]
    r = (shape[1] - 1) / 2
    field = (y - r) ** 2 + (x - (shape[2] - 1) / 2) ** 2 <= r**2
    raw = ct_phantom(shape, spacing, ("Lung nodule",), rng) + np.int16(1024)
    yield from write_dicom_series(out / "dicom" / "patient_1" / "CT",
                                  np.where(field, raw, np.int16(-2000)), spacing,
                                  padding_value=-2000)  # fmt: skip
    (out / "arrays").mkdir(parents=True, exist_ok=True)
    np.save(out / "arrays" / "volume_1.npy", ct_phantom(shape, spacing, ("Emphysema",), rng))
    sidecar = {"spacing_zyx_mm": list(spacing), "units": "hu"}
    (out / "arrays" / "volume_1.json").write_text(json.dumps(sidecar) + "\n")
    yield out / "arrays" / "volume_1.npy"
    (out / "nifti").mkdir(parents=True, exist_ok=True)
    raw = ct_phantom(shape, spacing, ("Cardiomegaly",), rng) + np.int16(1024)
    write_nifti(out / "nifti" / "scaled_1.nii.gz", raw, spacing, slope=1.0, intercept=-1024.0)
    yield out / "nifti" / "scaled_1.nii.gz"


def make_ct_faults(out: Path, size: str, rng: np.random.Generator) -> Iterator[Path]:
    """Raw CT items that must each fail their own partition, naming their file: an all-air
    scan (no tissue: HU cannot be decided), two names that sanitise to one key, and a NIfTI
    header that claims far more voxels than its file holds."""
    shape, spacing = CT_SIZES[size]
    (out / "faults").mkdir(parents=True, exist_ok=True)
    air = np.full(shape, -1000, np.int16) + rng.integers(-20, 20, shape).astype(np.int16)
    write_nifti(out / "faults" / "all_air.nii.gz", air, spacing)
    yield out / "faults" / "all_air.nii.gz"
    scan = ct_phantom(shape, spacing, (), rng)
    for name in ("twin scan.nii.gz", "twin_scan.nii.gz"):
        write_nifti(out / "faults" / name, scan, spacing)
        yield out / "faults" / name
    hostile = out / "faults" / "hostile.nii"
    write_nifti(hostile, np.zeros((2, 2, 2), np.int16), (1.0, 1.0, 1.0))
    header = bytearray(hostile.read_bytes()[:352])
    header[42:48] = np.array([1200, 1200, 1200], "<i2").tobytes()  # dim[1..3]: 3.4 GB claimed
    hostile.write_bytes(bytes(header) + bytes(64))
    yield hostile


def _scene(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """RGB float32 texture in [0, 1]: smooth colour noise plus bright and dark discs."""
    h, w = shape
    img = np.stack([_smooth_noise(shape, rng, coarse=c) for c in (6, 10, 16)], axis=-1)
    img = 0.5 + 0.35 * img
    yy, xx = np.mgrid[:h, :w]
    for _ in range(12):
        cy, cx, rad = rng.integers(0, h), rng.integers(0, w), rng.integers(4, max(5, h // 10))
        img[(yy - cy) ** 2 + (xx - cx) ** 2 <= rad**2] = rng.uniform(0.05, 0.95, size=3)
    return np.clip(img, 0, 1).astype(np.float32)


def make_gopro_spike(
    out: Path, sequences: int, samples: int, size: str, rng: np.random.Generator
) -> Iterator[Path]:
    h, w = SPIKE_SIZES[size]
    names = ["GOPR0372_07_00", "GOPR0384_11_00", "GOPR0374_11_00", "GOPR0385_11_01"]
    for s in range(sequences):
        split = "test" if s % 2 else "train"
        seq = out / split / (names[s] if s < len(names) else f"GOPR{900 + s:04d}_11_00")
        steps = samples * SPIKE_SUBFRAMES
        velocity = rng.uniform(0.6, 1.4, size=2) * np.array([0.5, 1.0])
        scene = _scene((h + int(steps * velocity[0]) + 2, w + int(steps * velocity[1]) + 2), rng)
        for n in range(samples):
            sub = []
            for t in range(SPIKE_SUBFRAMES):
                oy, ox = (np.array([n * SPIKE_SUBFRAMES + t] * 2) * velocity).astype(int)
                sub.append(scene[oy : oy + h, ox : ox + w])
            sub_frames = np.stack(sub)
            gray = to_gray(sub_frames)
            stem = f"{n:06d}"
            files = {
                "sharp": (seq / "sharp" / f"{stem}.png", sub_frames[SPIKE_SUBFRAMES // 2]),
                "blur": (seq / "blur" / f"{stem}.png", sub_frames.mean(axis=0)),
            }
            for path, rgb in files.values():
                path.parent.mkdir(parents=True, exist_ok=True)
                write_image(path, np.rint(rgb * 255).astype(np.uint8))
            seed = int(rng.integers(0, 2**31))
            for folder, layout, repeat in (
                ("spike", "bytes", 1),
                ("spike_packed", "packed", SPIKE_PACKED_REPEAT),
            ):
                path = seq / folder / f"{stem}.dat"
                path.parent.mkdir(parents=True, exist_ok=True)
                write_dat(
                    path, simulate_spikes(gray, threshold=1.0, seed=seed, repeat=repeat), layout
                )
            yield seq / "sharp" / f"{stem}.png"
    out.mkdir(parents=True, exist_ok=True)  # also with no sequence at all
    (out / "dataset.json").write_text(
        json.dumps(
            {
                "height": h,
                "width": w,
                "subframes_per_sample": SPIKE_SUBFRAMES,
                "layouts": {
                    "spike": {"layout": "bytes", "frames": SPIKE_SUBFRAMES},
                    "spike_packed": {
                        "layout": "packed",
                        "frames": SPIKE_SUBFRAMES * SPIKE_PACKED_REPEAT,
                    },
                },
            },
            indent=1,
        )
        + "\n"
    )


def make_inspection(out: Path, count: int, rng: np.random.Generator) -> Iterator[Path]:
    """Stripe images: channel 0 is the target, channels 1–2 are references of the same texture."""
    h, w, _ = INSPECTION_SHAPE
    for i in range(count):
        split = "test" if i >= count - max(1, count // 4) else "train"
        period = rng.uniform(6, 14)
        xx = np.arange(w, dtype=np.float32)
        stripes = 0.5 + 0.25 * np.sin(2 * np.pi * xx / period)[None, :]
        base = stripes + 0.08 * _smooth_noise((h, w), rng, coarse=16)
        channels = [base + rng.normal(0, 0.015, size=(h, w)) for _ in range(3)]
        img = np.rint(np.clip(np.stack(channels, axis=-1), 0, 1) * 255).astype(np.uint8)
        path = out / split / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_image(path, img)
        yield path


def make_sample_data(
    out: str | Path,
    scans: int = 4,
    sequences: int = 2,
    samples_per_sequence: int = 6,
    images: int = 8,
    size: str = "small",
    seed: int = 0,
    progress: Callable[[Iterator[Path], str, int], Iterator[Path]] | None = None,
) -> dict[str, list[str]]:
    """Write all three families under ``out``; returns the files made, per family."""
    if size not in CT_SIZES:
        raise ValueError(f"size must be one of {sorted(CT_SIZES)}, got {size!r}")
    out = Path(out)
    wrap = progress or (lambda it, _desc, _total: it)
    jobs = {
        "ct-rate": (
            make_ct_rate(out / "ct-rate", scans, size, np.random.default_rng([seed, 1])),
            scans,
        ),
        "gopro-spike": (
            make_gopro_spike(
                out / "gopro-spike",
                sequences,
                samples_per_sequence,
                size,
                np.random.default_rng([seed, 2]),
            ),
            sequences * samples_per_sequence,
        ),
        "inspection": (
            make_inspection(out / "inspection", images, np.random.default_rng([seed, 3])),
            images,
        ),
    }
    return {name: [str(p) for p in wrap(it, name, total)] for name, (it, total) in jobs.items()}
