"""Scale benchmarks: discovery, per-partition overhead, the nightly evaluation, manifests and a
training dataset at 50,000 partitions; and the store on a SeaweedFS server vs the local disk.

    python benchmarks/scale.py            # 50,000 raw files and partitions, the demo's CT stores
    python benchmarks/scale.py --quick    # 300 of each, small CT settings, 4 small volumes for
                                          # the S3 training epochs (CI smoke run)
    python benchmarks/scale.py --only s3  # only the object-storage lines (s3.*)
    python benchmarks/scale.py --production [--production-n 64]   # only the production
                                          # shape's orchestration lines (scale.production_*,
                                          # benchmarks/production.py): daemon, Postgres, Celery

What is synthetic (real data would not fit this machine): the raw tree is empty CT-RATE-named
NIfTI files (a few tiny real ones for the runs that read them) with a 50,000-row metadata
CSV; the committed partitions are commit records written straight into the store, shaped
like real ones (current fingerprints, 1 % stale), plus a synthetic consolidated patch index.
The S3 figures use the real sample data's CT scans built with the demo's settings, and
synthetic CT volumes for the training epochs; LitData (the ``bench`` extra) streams the same
patches from the same SeaweedFS bucket for ``s3.train_epoch1_vs_litdata``.

The figures at 50,000 partitions are measured in ``scale_partitions.py``, the object-storage
ones in ``scale_s3.py``; this script is their command line.
"""

import argparse
import os
import tempfile
import warnings
from pathlib import Path

import dagster as dg
import production
from scale_partitions import scale
from scale_s3 import s3_epochs, s3_vs_local, serve

warnings.filterwarnings("ignore", category=dg.BetaWarning)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="300 partitions (smoke run)")
    parser.add_argument(
        "--only",
        choices=["scale", "manifests", "s3", "epochs"],
        help="one part: the scale figures, the manifest/nightly/dataset ones (after the "
        "discovery they need), the S3 ones, or only the training epochs from S3 (with "
        "LitData's first epoch)",
    )
    production.add_arguments(parser)
    args = parser.parse_args()
    os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp())
    if args.production:
        with tempfile.TemporaryDirectory() as tmp:
            return production.main(Path(tmp), args)
    n, more, runs = (300, 30, 2) if args.quick else (50_000, 1000, 9)
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "scale", "manifests"):
            scale(Path(tmp), n, more, 0 if args.only == "manifests" else runs)
        if args.only in (None, "s3"):
            s3_vs_local(Path(tmp), args.quick)
        if args.only == "epochs":
            with serve(Path(tmp)) as server:
                s3_epochs(Path(tmp), server, args.quick)


if __name__ == "__main__":
    main()
