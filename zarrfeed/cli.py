"""The ``zarrfeed`` command."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _sample_data(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from zarrfeed.samples import make_sample_data

    t0 = time.perf_counter()
    made = make_sample_data(
        args.out,
        scans=args.scans,
        sequences=args.sequences,
        samples_per_sequence=args.samples,
        images=args.images,
        size=args.size,
        seed=args.seed,
        progress=lambda it, desc, total: tqdm(it, desc=desc, total=total, unit="file"),
    )
    counts = ", ".join(f"{k}: {len(v)}" for k, v in made.items())
    print(f"sample data in {args.out} ({counts}) in {time.perf_counter() - t0:.1f}s")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from zarrfeed.demo import format_table, run_demo

    raw = Path(args.raw)
    if not raw.exists():
        _sample_data(build_parser().parse_args(["sample-data", str(raw)]))
    t0 = time.perf_counter()
    rows = run_demo(raw, args.store, Path(args.dagster_home))
    print(format_table(rows))
    failed = [r for r in rows if not r["ok"]]
    print(
        f"{len(rows) - len(failed)}/{len(rows)} runs succeeded in {time.perf_counter() - t0:.0f}s; "
        f"store {args.store}; see them with: DAGSTER_HOME={args.dagster_home} "
        ".venv/bin/dagster dev -w workspace.yaml"
    )
    return 1 if failed else 0


def _hub(args: argparse.Namespace) -> int:
    from pathlib import Path

    from zarrfeed.demo import format_table, run_hub

    config = {
        "repo_id": args.repo,
        "revision": args.revision,
        "split": args.split,
        "max_scans": args.max_scans,
        "delete_after_commit": args.delete_after_commit,
    }
    config |= {k: v for k, v in (("cache_dir", args.cache_dir), ("endpoint", args.endpoint)) if v}
    rows = run_hub(config, args.store, Path(args.dagster_home))
    print(format_table(rows))
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} runs succeeded; token from HF_TOKEN")
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


def _train(args: argparse.Namespace) -> int:
    from zarrfeed.training.config import TrainConfig

    given = {"task": args.task, "store": args.store, "out": args.out}
    config = TrainConfig.load(args.config, **{k: v for k, v in given.items() if v is not None})
    if args.steps is not None:
        config.train.steps = args.steps
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0
    from zarrfeed.training.trainer import train

    result = train(config)
    if result.eval_after:  # rank 0 (torchrun runs this on every rank)
        print(f"checkpoint {result.checkpoint}; metrics {config.run_dir / 'metrics.json'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zarrfeed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample-data", help="write deterministic synthetic CT, spike and image data")
    p.add_argument("out", help="folder to write into")
    p.add_argument("--scans", type=int, default=4, help="CT volumes (CT-RATE layout)")
    p.add_argument("--sequences", type=int, default=2, help="spike/GoPro sequences")
    p.add_argument("--samples", type=int, default=6, help="samples per spike sequence")
    p.add_argument("--images", type=int, default=8, help="976×176×3 inspection images")
    p.add_argument(
        "--size",
        choices=["small", "full"],
        default="small",
        help="'full' makes CT-RATE-sized 512×512×300 scans and 396×640 spikes",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_sample_data)

    p = sub.add_parser("demo", help="build the whole asset graph on the sample data")
    p.add_argument("--raw", default="data/raw", help="raw folder (sample data made if absent)")
    p.add_argument("--store", default="data/zarrfeed.zarr", help="Zarr store folder or URL")
    p.add_argument("--dagster-home", default=".dagster_home", help="persistent Dagster instance")
    p.set_defaults(func=_demo)

    p = sub.add_parser("hub", help="discover and build CT-RATE volumes from the Hugging Face hub")
    p.add_argument("--repo", default="ibrahimhamamci/CT-RATE")
    p.add_argument("--revision", default="main")
    p.add_argument("--split", choices=["train", "valid"], default="valid")
    p.add_argument("--max-scans", type=int, default=None, help="build only the first N volumes")
    p.add_argument("--cache-dir", default=None, help="download cache (default: the HF cache)")
    p.add_argument("--endpoint", default=None, help="hub URL (default: HF_ENDPOINT or the hub)")
    p.add_argument("--delete-after-commit", action="store_true", help="free disk as it goes")
    p.add_argument("--store", default="data/zarrfeed.zarr")
    p.add_argument("--dagster-home", default=".dagster_home")
    p.set_defaults(func=_hub)

    p = sub.add_parser("benchmark-loader", help="throughput and cache statistics of a loader")
    p.add_argument("--store", default="data/zarrfeed.zarr", help="Zarr store folder or URL")
    p.add_argument("--dataset", choices=sorted(DATASETS), default="ct-patches")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=50, help="batches to time")
    p.add_argument("--workers", default="auto", help="'auto', 'cpu*0.9' or a number")
    p.add_argument("--cache-gb", type=float, default=2.0, help="shared cache budget")
    p.add_argument("--autotune", action="store_true", help="measure worker counts first")
    p.set_defaults(func=_benchmark_loader)

    p = sub.add_parser(
        "train", help="train a model on the store (also under torchrun: DDP, one shard per rank)"
    )
    p.add_argument("--config", help="YAML file (sections data, dataloader, train); see configs/")
    p.add_argument("--task", help="override the config's task (see --print-config)")
    p.add_argument("--store", help="override the store URL")
    p.add_argument("--out", help="override the checkpoint folder")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--print-config", action="store_true", help="print the resolved config")
    p.set_defaults(func=_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from zarrfeed.errors import ZarrfeedError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ZarrfeedError as exc:  # bad input or store state: the message says what to do
        print(f"zarrfeed {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
