"""zarrfeed: chunked Zarr stores of CT volumes, spike-camera streams and inspection images,
built by Dagster assets and fed to PyTorch training."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zarrfeed.commands import (
    benchmark_loader,
    cache,
    datasets,
    demo,
    hub,
    inspect,
    partitions,
    sample_data,
    status,
    train,
    verify,
)
from zarrfeed.errors import ZarrfeedError

EXAMPLES = """\
examples:
  zarrfeed demo                                 build everything from the sample data, train
  zarrfeed status                               what is missing, stale or failed, and the fix
  zarrfeed inspect ct_windows train_1_a_1       arrays, provenance, checks; writes previews
  zarrfeed verify                               re-check every partition (exit 1 unless all ok)
  zarrfeed partitions remove ct train_9_z_9     drop a partition that has no raw source
  zarrfeed train --config configs/ct_classifier.yaml
  zarrfeed datasets list                        dataset versions kept, and models trained on each
  zarrfeed train --task ct_classifier --dataset-version ID   train on exactly that version
  zarrfeed sample-data data/raw --with-faults   sample data plus CT sources that must fail

Store and instance default to ZARRFEED_STORE (else data/zarrfeed.zarr) and DAGSTER_HOME
(else .dagster_home); `zarrfeed COMMAND --help` shows each command's options.
"""
# One module per subcommand (zarrfeed/commands/), each adding its parser.
COMMANDS = (
    sample_data, demo, hub, benchmark_loader, cache, inspect, verify, status, partitions, datasets
)  # fmt: skip


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; ``train``'s options only when ``argv`` may name it (None: always)."""
    parser = argparse.ArgumentParser(
        prog="zarrfeed",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    train.add_parser(sub, options=argv is None or "train" in argv)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        sys.stderr.close()
        return 0
    except ZarrfeedError as exc:  # bad input or store state: the message says what to do
        print(f"zarrfeed {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path it cannot read or write (permissions, a full disk)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"zarrfeed {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"zarrfeed {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
