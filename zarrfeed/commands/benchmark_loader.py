"""``zarrfeed benchmark-loader``: throughput and cache statistics of a family's training
reader over a store, with the loader configuration it would recommend."""

from __future__ import annotations

import argparse
from typing import Any

from zarrfeed.commands.options import count, default_store
from zarrfeed.errors import ConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("benchmark-loader", help="throughput and cache statistics of a loader")
    p.add_argument("--store", default=default_store(), help="Zarr store folder or URL")
    p.add_argument(
        "--dataset", default="ct-patches", help="a family's reader (ct-patches, spike, ...)"
    )
    p.add_argument("--batch", type=count(1), default=8)
    p.add_argument("--batches", type=count(1), default=50, help="batches to time")
    p.add_argument("--workers", default="auto", help="'auto', 'cpu*0.9' or a number")
    p.add_argument("--cache-gb", type=float, default=2.0, help="shared cache budget")
    p.add_argument("--autotune", action="store_true", help="measure worker counts first")
    p.set_defaults(func=main)


def reader(name: str) -> Any:
    """The training reader ``name`` among the code location's families."""
    from zarrfeed.commands.options import families

    readers = {r.name: r for c in families() for r in c.declaration.readers}
    if name not in readers:
        raise ConfigError(f"no reader {name!r}; the readers are {', '.join(sorted(readers))}")
    return readers[name]


def main(args: argparse.Namespace) -> int:
    from zarrfeed import training

    found = reader(args.dataset)
    dataset = found.load()(args.store, cache_gb=args.cache_gb, **found.options)
    if args.autotune:
        plan = training.autotune(dataset, args.batch, batches=args.batches)
        workers: int | str = plan.num_workers
        print("\n".join(plan.reasons[-1:]))
    else:
        workers = int(args.workers) if args.workers.isdigit() else args.workers
    loader, plan = training.make_loader(dataset, args.batch, workers)  # the loading plan
    print(f"dataset: {type(dataset).__name__} over {args.store}: {len(dataset)} samples")
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
