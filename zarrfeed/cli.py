"""zarrfeed: chunked Zarr stores of CT volumes, spike-camera streams and inspection images,
built by Dagster assets and fed to PyTorch training."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from zarrfeed.errors import ConfigError

EXAMPLES = """\
examples:
  zarrfeed demo                                 build everything from the sample data, train
  zarrfeed status                               what is missing, stale or failed, and the fix
  zarrfeed inspect ct_windows train_1_a_1       arrays, provenance, checks; writes previews
  zarrfeed verify                               re-check every partition (exit 1 unless all ok)
  zarrfeed partitions remove ct train_9_z_9     drop a partition that has no raw source
  zarrfeed train --config configs/ct_classifier.yaml
  zarrfeed sample-data data/raw --with-faults   sample data plus CT sources that must fail

Store and instance default to ZARRFEED_STORE (else data/zarrfeed.zarr) and DAGSTER_HOME
(else .dagster_home); `zarrfeed COMMAND --help` shows each command's options.
"""
STORE = os.environ.get("ZARRFEED_STORE", "data/zarrfeed.zarr")
STATES = ("missing", "stale", "failed", "running", "conflict", "no source")  # zarrfeed status


def _sample_data(args: argparse.Namespace, bars: bool = True) -> int:
    """``bars``: a progress bar per family (the demo, which has its own display, says less)."""
    import numpy as np
    from tqdm import tqdm

    from zarrfeed.samples import make_ct_faults, make_ct_sources, make_sample_data

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file: give a folder to write the sample data into")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ConfigError(
            f"{out} is not empty: sample-data would replace files of the same names there; "
            "give a new or empty folder, or pass --force to overwrite"
        )
    t0 = time.perf_counter()
    made = make_sample_data(
        out,
        scans=args.scans,
        sequences=args.sequences,
        samples_per_sequence=args.samples,
        images=args.images,
        size=args.size,
        seed=args.seed,
        progress=(lambda it, desc, total: tqdm(it, desc=desc, total=total, unit="file"))
        if bars
        else None,
    )
    if args.with_faults:
        rng = np.random.default_rng([args.seed, 13])
        made["ct-sources"] = [str(p) for p in make_ct_sources(out / "ct-sources", args.size, rng)]
        made["ct-faults"] = [str(p) for p in make_ct_faults(out / "ct-sources", args.size, rng)]
    counts = ", ".join(f"{k}: {len(v)}" for k, v in made.items())
    print(f"sample data in {out} ({counts}) in {time.perf_counter() - t0:.1f}s")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from zarrfeed.commands.demo import (
        output_to,
        print_summary,
        progress_display,
        run_demo,
        ui_command,
    )

    raw, home = Path(args.raw), Path(args.dagster_home)
    if raw.exists() and not raw.is_dir():
        raise ConfigError(f"--raw {raw} is a file: give the folder of raw data")
    if not raw.exists():
        _sample_data(build_parser().parse_args(["sample-data", str(raw)]), bars=False)
    log = home.resolve() / "demo.log"
    t0 = time.perf_counter()
    with output_to(log) as terminal:
        rows = run_demo(raw, args.store, home, lambda total: progress_display(total, terminal))
    print_summary(rows, sys.stdout)
    failed = [r for r in rows if not r.ok]
    env = {
        "ZARRFEED_STORE": args.store,
        "ZARRFEED_RAW": str(raw),
        "ZARRFEED_MODELS": os.environ.get("ZARRFEED_MODELS", "data/models"),
    }
    print(
        f"{len(rows) - len(failed)}/{len(rows)} runs succeeded in {time.perf_counter() - t0:.0f}s;"
        f" store {args.store}; full log {log}\n"
        f"See every run, partition, check and preview in the UI:\n  {ui_command(home, env)}"
    )
    return 1 if failed else 0


def _hub(args: argparse.Namespace) -> int:
    from zarrfeed.commands.demo import output_to, print_summary, progress_display, run_hub

    if not os.environ.get("HF_TOKEN"):
        print(
            "zarrfeed hub: HF_TOKEN is not set, so only public, ungated repositories can be "
            f"read; {args.repo} needs a read token of an account that accepted its terms: "
            "export HF_TOKEN=hf_...",
            file=sys.stderr,
        )
    config = {
        "repo_id": args.repo,
        "revision": args.revision,
        "split": args.split,
        "max_scans": args.max_scans,
        "delete_after_commit": args.delete_after_commit,
    }
    config |= {k: v for k, v in (("cache_dir", args.cache_dir), ("endpoint", args.endpoint)) if v}
    home = Path(args.dagster_home)
    log = home.resolve() / "hub.log"
    with output_to(log) as terminal, progress_display(None, terminal) as progress:
        rows = run_hub(config, args.store, home, progress)
    print_summary(rows, sys.stdout)
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} runs succeeded; full log {log}")
    return 1 if failed else 0


DATASETS = {
    "ct-patches": ("CTPatchDataset", {}),
    "ct-volumes": ("CTPatchDataset", {"patch": False}),
    "sparse": ("SparsePointsDataset", {}),
    "spike": ("SpikeClipDataset", {}),
    "images": ("ImagePatchDataset", {}),
}


def _benchmark_loader(args: argparse.Namespace) -> int:
    from zarrfeed import training

    name, kwargs = DATASETS[args.dataset]
    dataset = getattr(training, name)(args.store, cache_gb=args.cache_gb, **kwargs)
    collate = training.collate_points if args.dataset == "sparse" else None
    if args.autotune:
        plan = training.autotune(dataset, args.batch, collate_fn=collate, batches=args.batches)
        workers: int | str = plan.num_workers
        print("\n".join(plan.reasons[-1:]))
    else:
        workers = int(args.workers) if args.workers.isdigit() else args.workers
    loader, plan = training.make_loader(dataset, args.batch, workers, collate_fn=collate)
    print(f"dataset: {name} over {args.store}: {len(dataset)} samples")
    report = training.measure(loader, args.batches)
    stats = dataset.cache.stats()
    print(
        f"throughput: {report.samples_per_s:.1f} samples/s over {report.batches} batches of "
        f"{args.batch}\n"
        f"data time per batch: {report.batch_mean_ms:.2f} ± {report.batch_std_ms:.2f} ms "
        f"({report.batch_mean_ms / args.batch:.3f} ms per sample); first batch "
        f"{report.first_batch_s:.2f} s (worker start-up)\n"
        f"cache: {stats['hits']} hits, {stats['misses']} misses ({stats['hit_rate']:.1%}), "
        f"{stats['bytes_held'] / 1e9:.2f} of {stats['budget_bytes'] / 1e9:.2f} GB held, "
        f"{stats['evictions']} evictions"
    )
    print("recommendation: " + training.recommend(plan, stats, dataset.nbytes()))
    return 0


def _cache(args: argparse.Namespace) -> int:
    from zarrfeed.training.data.shm import clear_caches, list_caches, shm_root

    if args.action == "list":
        found = list_caches()
        held = sum(c.bytes for c in found) / 1e9
        print(f"{len(found)} cache(s) in {shm_root()}, {held:.2f} GB held")
        for c in found:
            owners = ",".join(map(str, c.owners)) or "none"
            print(
                f"{c.name}  {c.kind:7} {c.bytes / 1e9:7.3f} GB  idle {c.idle_s / 3600:6.1f} h  "
                f"owners {owners}  {c.store} {c.what}"
            )
        return 0
    if not args.all and not args.names:
        print("zarrfeed cache clear: name caches to clear, or --all", file=sys.stderr)
        return 2
    removed, busy = clear_caches(None if args.all else args.names)
    print(
        f"removed {len(removed)} cache(s)" + (f"; in use, kept: {', '.join(busy)}" if busy else "")
    )
    unknown = [n for n in args.names or [] if n not in removed and n not in busy]
    if unknown:
        print(f"zarrfeed cache clear: no cache named {', '.join(unknown)} "
              "(`zarrfeed cache list` names them)", file=sys.stderr)  # fmt: skip
        return 2
    return 0


def _existing(url: str) -> None:
    """Refuse a store that does not exist: read as empty, a mistyped --store would report
    every partition as gone (and advise removing them)."""
    from zarrfeed.errors import StoreError
    from zarrfeed.store import ZarrStore

    store = ZarrStore(url)
    if not store.exists():
        raise StoreError(
            f"no zarrfeed store at {store.url}: check --store (or ZARRFEED_STORE); a build or "
            "`zarrfeed demo` creates one"
        )


def _partitions(args: argparse.Namespace) -> int:
    from zarrfeed.commands import partitions
    from zarrfeed.commands.instance import home_of, open_instance
    from zarrfeed.resources import ZarrStoreResource

    _existing(args.store)
    resource = ZarrStoreResource(url=args.store)
    store, catalog = resource.store(), resource.catalog(args.family)
    home = home_of(args.dagster_home)
    instance = open_instance(home) if home else None
    try:
        removal = partitions.plan(args.family, args.key, store, catalog, instance)
        print("This removes " + "; ".join(removal.lines()) + ".")
        if not partitions.confirm("Remove?", args.yes):
            print("nothing removed")
            return 1
        partitions.execute(removal, store, catalog, instance)
    finally:
        if instance is not None:
            instance.dispose()
    print(f"removed {args.family} partition {args.key}")
    if removal.in_dataset:
        print(
            f"the {args.family} dataset manifest still lists it: refresh it with "
            "`dg launch -m zarrfeed.definitions --job datasets_build`"
        )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from zarrfeed.commands import inspect
    from zarrfeed.commands.output import codec_text, human_bytes, print_json, print_table
    from zarrfeed.store import ZarrStore

    _existing(args.store)
    store = ZarrStore(args.store)
    if args.asset is None:
        rows = inspect.overview(store)
        if args.json:
            print_json(rows)
            return 0
        print_table(
            ["asset", "path", "partitions", "stored", "in memory", "ratio"],
            [
                [
                    r["asset"],
                    r["path"],
                    r["partitions"],
                    human_bytes(r["stored_bytes"]),
                    human_bytes(r["raw_bytes"]),
                    r["ratio"],
                ]
                for r in rows
            ],
            title=f"store {store.url}",
        )
        return 0
    spec = inspect.resolve(args.asset)
    if args.key is None:
        rows = inspect.partitions(store, spec)
        if args.json:
            print_json(rows)
            return 0
        print_table(
            ["key", "committed", "arrays", "shape", "dtype", "stored", "ratio", "checks"],
            [
                [
                    r["key"],
                    r["committed"],
                    r["arrays"],
                    "×".join(map(str, r["shape"])),
                    r["dtype"],
                    human_bytes(r["stored_bytes"]),
                    r["ratio"],
                    r["checks"],
                ]
                for r in rows
            ],
            title=f"{spec.name} ({spec.path}) in {store.url}",
        )
        return 0
    info = inspect.partition(store, spec, args.key)
    written = inspect.write_previews(store, spec, args.key, Path(args.previews))
    info["previews"] = [str(p) for p in written]
    if args.json:
        print_json(info)
        return 0
    arrays = info["arrays"]
    print_table(
        ["array", "shape", "dtype", "chunks", "shards", "codec", "in memory"],
        [
            [
                n,
                "×".join(map(str, a["shape"])),
                a["dtype"],
                "×".join(map(str, a["chunks"])),
                "×".join(map(str, a["shards"])) if a.get("shards") else "-",
                codec_text(a.get("codec")),
                human_bytes(a["nbytes"]),
            ]
            for n, a in arrays.items()
        ],
        title=f"{spec.name} {args.key}: version {info['version']}, committed {info['committed']}",
        notes=[
            f"stored {human_bytes(info['stored_bytes'])} of "
            f"{human_bytes(sum(a['nbytes'] for a in arrays.values()))} in memory; {info['url']}",
            *(f"{k}: {v}" for k, v in info["provenance"].items()),
            "checks: "
            + (
                ", ".join(f"{n} {'ok' if ok else 'FAILED'}" for n, ok in info["checks"].items())
                or "none"
            ),
            *(f"preview: {p}" for p in written),
        ],
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from zarrfeed.commands import inspect, verify
    from zarrfeed.commands.output import print_json, print_table
    from zarrfeed.resources import ZarrStoreResource
    from zarrfeed.store.contract import FAMILIES, STORED

    _existing(args.store)
    resource = ZarrStoreResource(url=args.store)
    specs = [inspect.resolve(args.asset)] if args.asset else list(STORED.values())
    catalogs = {f: resource.catalog(f) for f in FAMILIES}
    findings = verify.verify(resource.store(), specs, catalogs, args.key)
    bad = [f for f in findings if f.status == "MISMATCH"]
    unverified = [f for f in findings if f.status == "unverified"]
    if args.json:
        print_json([f.to_json() for f in findings])
    else:
        print_table(
            ["asset", "key", "status", "details"],
            [[f.asset, f.key, f.status, "; ".join(f.details)] for f in findings],
            title=f"verify {resource.url}",
            notes=[
                f"{len(findings)} partitions: {len(bad)} mismatched, {len(unverified)} unverified"
            ],
        )
    return 1 if bad or unverified else 0


def _status(args: argparse.Namespace) -> int:
    from zarrfeed.assets import SETTINGS
    from zarrfeed.commands import status
    from zarrfeed.commands.instance import home_of, open_instance
    from zarrfeed.commands.output import print_json, print_table
    from zarrfeed.definitions import RESOURCES
    from zarrfeed.resources import ZarrStoreResource
    from zarrfeed.store.contract import FAMILIES

    _existing(args.store)
    resource = ZarrStoreResource(url=args.store)
    store = resource.store()
    home = home_of(args.dagster_home)
    instance = open_instance(home) if home else None
    summary, entries = [], []
    try:
        for family, spec in FAMILIES.items():
            keys = instance.get_dynamic_partitions(spec.partitions) if instance else None
            states = status.partition_states(instance, family, keys) if instance else {}
            settings = RESOURCES[SETTINGS[family]].values()
            total, found = status.family_status(
                family, store, resource.catalog(family), settings, keys, states
            )
            counts = {"family": family, "partitions": total}
            for e in found:
                counts[e.state] = counts.get(e.state, 0) + len(e.keys)
            summary.append(counts)
            entries += found
    finally:
        if instance is not None:
            instance.dispose()
    if args.json:
        print_json({"instance": str(home) if home else None, "families": summary,
                    "problems": [e.to_json() for e in entries]})  # fmt: skip
        return 1 if entries else 0
    where = f"instance {home}" if home else "no Dagster instance (partitions from the catalog)"
    print_table(
        ["family", "partitions", *STATES],
        [
            [
                s["family"],
                s["partitions"],
                *(s.get(k, 0) for k in STATES),
            ]
            for s in summary
        ],
        title=f"store {store.url}; {where}",
    )
    if entries:
        print_table(
            ["family", "state", "partitions", "why", "fix"],
            [
                [
                    e.family,
                    e.state,
                    ", ".join(e.keys[:5]) + (" …" if len(e.keys) > 5 else ""),
                    e.why,
                    e.fix,
                ]
                for e in entries
            ],
        )
    else:
        print("every partition is current")
    return 1 if entries else 0


def _train(args: argparse.Namespace) -> int:
    from zarrfeed.commands import train

    return train.run(args)


def _reader_options(
    p: argparse.ArgumentParser, func: Callable, instance: bool = True, json: bool = True
) -> None:
    """The options of the commands that read the store (and the instance)."""
    p.add_argument("--store", default=STORE, help="Zarr store folder or URL")
    if instance:
        p.add_argument("--dagster-home", help="instance (default: DAGSTER_HOME, .dagster_home)")
    if json:
        p.add_argument("--json", action="store_true", help="JSON for scripts")
    p.set_defaults(func=func)


def count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least`` (argparse names the flag)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {least}, found {value}")
        return value

    parse.__name__ = "count"
    return parse


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; ``train``'s options only when ``argv`` may name it (None: always), as they
    come from the training config, whose package loads torch: ``--help`` stays quick."""
    parser = argparse.ArgumentParser(
        prog="zarrfeed",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample-data", help="write deterministic synthetic CT, spike and image data")
    p.add_argument("out", help="folder to write into")
    p.add_argument("--scans", type=count(0), default=4, help="CT volumes (CT-RATE layout)")
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
    p.set_defaults(func=_sample_data)

    p = sub.add_parser("demo", help="build the whole asset graph on the sample data")
    p.add_argument("--raw", default="data/raw", help="raw folder (sample data made if absent)")
    p.add_argument("--store", default=STORE, help="Zarr store folder or URL")
    p.add_argument("--dagster-home", default=".dagster_home", help="persistent Dagster instance")
    p.set_defaults(func=_demo)

    p = sub.add_parser("hub", help="discover and build CT-RATE volumes from the Hugging Face hub")
    p.add_argument("--repo", default="ibrahimhamamci/CT-RATE")
    p.add_argument("--revision", default="main")
    p.add_argument("--split", choices=["train", "valid"], default="valid")
    p.add_argument("--max-scans", type=count(1), help="build only the first N volumes")
    p.add_argument("--cache-dir", default=None, help="download cache (default: the HF cache)")
    p.add_argument("--endpoint", default=None, help="hub URL (default: HF_ENDPOINT or the hub)")
    p.add_argument("--delete-after-commit", action="store_true", help="free disk as it goes")
    p.add_argument("--store", default=STORE, help="Zarr store folder or URL")
    p.add_argument("--dagster-home", default=".dagster_home")
    p.set_defaults(func=_hub)

    p = sub.add_parser("benchmark-loader", help="throughput and cache statistics of a loader")
    p.add_argument("--store", default=STORE, help="Zarr store folder or URL")
    p.add_argument("--dataset", choices=sorted(DATASETS), default="ct-patches")
    p.add_argument("--batch", type=count(1), default=8)
    p.add_argument("--batches", type=count(1), default=50, help="batches to time")
    p.add_argument("--workers", default="auto", help="'auto', 'cpu*0.9' or a number")
    p.add_argument("--cache-gb", type=float, default=2.0, help="shared cache budget")
    p.add_argument("--autotune", action="store_true", help="measure worker counts first")
    p.set_defaults(func=_benchmark_loader)

    p = sub.add_parser("cache", help="list or clear the shared training caches in /dev/shm")
    p.add_argument("action", choices=["list", "clear"])
    p.add_argument("names", nargs="*", help="caches to clear (as `list` names them)")
    p.add_argument("--all", action="store_true", help="clear every cache no process holds")
    p.set_defaults(func=_cache)

    p = sub.add_parser("inspect", help="shapes, dtypes, chunks, sizes, provenance; previews")
    p.add_argument("asset", nargs="?", help="a stored asset (ct_windows or ct/windows)")
    p.add_argument("key", nargs="?", help="one partition of it")
    p.add_argument("--previews", default="previews", help="where preview PNGs are written")
    _reader_options(p, _inspect, instance=False)

    p = sub.add_parser("verify", help="re-check partitions against checksums and raw sources")
    p.add_argument("asset", nargs="?", help="only this stored asset")
    p.add_argument("key", nargs="?", help="only this partition")
    _reader_options(p, _verify, instance=False)

    p = sub.add_parser("status", help="per family: missing, stale, failed, running; the fix")
    _reader_options(p, _status)

    p = sub.add_parser("partitions", help="remove a partition that has no raw source")
    p.add_argument("action", choices=["remove"])
    p.add_argument("family", help="ct, spike or images")
    p.add_argument("key", help="the partition key")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    _reader_options(p, _partitions, json=False)

    p = sub.add_parser(
        "train", help="train a model on the store (also under torchrun: DDP, one shard per rank)"
    )
    if argv is None or "train" in argv:
        from zarrfeed.commands import train

        train.add_arguments(p)
    p.set_defaults(func=_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from zarrfeed.errors import ZarrfeedError

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
