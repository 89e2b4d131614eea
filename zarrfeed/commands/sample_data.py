"""``zarrfeed sample-data OUT``: deterministic synthetic CT, spike and image data, and with
``--with-faults`` CT sources of other formats and CT items that must each fail alone."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from zarrfeed.commands.options import count
from zarrfeed.errors import ConfigError

# CT scans of the sample data the demo builds: 6 train_ and 2 valid_ ones, the fewest whose
# held-out valid_ scans hold both classes of every finding the phantom draws, so the
# classifier's AUROC on scans it never trained on is defined (with 4, one valid_ scan).
DEMO_SCANS = 8


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sample-data", help="write deterministic synthetic CT, spike and image data")
    p.add_argument("out", help="folder to write into")
    p.add_argument(
        "--scans",
        type=count(0),
        default=DEMO_SCANS,
        help="CT volumes (CT-RATE layout; a quarter valid_, held out of the classifier's training)",
    )
    p.add_argument("--sequences", type=count(0), default=2, help="spike/GoPro sequences")
    p.add_argument("--samples", type=count(1), default=6, help="samples per spike sequence")
    p.add_argument("--images", type=count(0), default=8, help="976×176×3 inspection images")
    p.add_argument(
        "--size",
        choices=["small", "full"],
        default="small",
        help="'full' makes CT-RATE-sized 512×512×300 scans and 396×640 spikes",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--with-faults",
        action="store_true",
        help="also a DICOM series, an .npy volume, a header-scaled NIfTI and three CT items "
        "that must each fail their own partition (ct-sources/)",
    )
    p.add_argument("--force", action="store_true", help="write into a non-empty folder")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    return write(
        Path(args.out),
        scans=args.scans,
        sequences=args.sequences,
        samples=args.samples,
        images=args.images,
        size=args.size,
        seed=args.seed,
        with_faults=args.with_faults,
        force=args.force,
    )


def write(
    out: Path,
    scans: int = DEMO_SCANS,
    sequences: int = 2,
    samples: int = 6,
    images: int = 8,
    size: str = "small",
    seed: int = 0,
    with_faults: bool = False,
    force: bool = False,
    bars: bool = True,
) -> int:
    """Write the sample data into ``out``; ``bars``: a progress bar per family (the demo,
    which has its own display, says less)."""
    import numpy as np
    from rich.progress import track

    from zarrfeed.samples import make_ct_faults, make_ct_sources, make_sample_data

    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file: give a folder to write the sample data into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(
            f"{out} is not empty: sample-data would replace files of the same names there; "
            "give a new or empty folder, or pass --force to overwrite"
        )
    t0 = time.perf_counter()
    made = make_sample_data(
        out,
        scans=scans,
        sequences=sequences,
        samples_per_sequence=samples,
        images=images,
        size=size,
        seed=seed,
        progress=(lambda it, desc, total: track(it, description=desc, total=total))
        if bars
        else None,
    )
    if with_faults:
        rng = np.random.default_rng([seed, 13])
        made["ct-sources"] = [str(p) for p in make_ct_sources(out / "ct-sources", size, rng)]
        made["ct-faults"] = [str(p) for p in make_ct_faults(out / "ct-sources", size, rng)]
    counts = ", ".join(f"{k}: {len(v)}" for k, v in made.items())
    print(f"sample data in {out} ({counts}) in {time.perf_counter() - t0:.1f}s")
    return 0
