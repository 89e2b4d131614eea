"""``zarrfeed hub``: list a CT-RATE split on the Hugging Face hub, then build each volume, the
demo's way (runs launched as the UI launches them, into a persistent instance)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from zarrfeed import defaults
from zarrfeed.commands.demo import (
    PARTITION_TAG,
    Progress,
    Row,
    output_to,
    print_summary,
    progress_display,
    run,
    use_home,
)
from zarrfeed.commands.instance import hold_home
from zarrfeed.commands.launcher import code_location
from zarrfeed.commands.options import count


def run_hub(
    hf_config: dict, store: str, home: Path, progress: Progress = lambda _: None
) -> list[Row]:
    """List the hub split of every family with a hub source (partitions appear), then build
    each volume."""
    use_home(
        home,
        ZARRFEED_STORE=store,
        ZARRFEED_RAW=os.environ.get("ZARRFEED_RAW", defaults.RAW),
        ZARRFEED_MODELS=os.environ.get("ZARRFEED_MODELS", defaults.MODELS),
    )
    import dagster as dg

    from zarrfeed.components import project_families

    run_config = {"resources": {"hf": {"config": hf_config}}}
    rows: list[Row] = []
    with dg.DagsterInstance.get() as instance, code_location(home, instance) as launcher:
        for family in [c.declaration for c in project_families()]:
            if family.hub is None:
                continue
            progress(f"{family.name} hub listing")
            rows.append(run(launcher, family.hub.job, "hub", "catalog", run_config=run_config))
            if not rows[-1].ok:
                return rows
            keys = sorted(instance.get_dynamic_partitions(family.partitions))
            if hf_config.get("max_scans"):
                keys = keys[: hf_config["max_scans"]]
            for key in keys:
                progress(f"hub volume {key}")
                tags = {PARTITION_TAG: key}
                rows.append(
                    run(launcher, family.build_job, "hub", key, tags=tags, run_config=run_config)
                )
    return rows


def add_parser(sub: Any) -> None:
    p = sub.add_parser("hub", help="discover and build CT-RATE volumes from the Hugging Face hub")
    p.add_argument("--repo", default=defaults.HUB_REPO)
    p.add_argument("--revision", default="main")
    p.add_argument("--split", choices=["train", "valid"], default="valid")
    p.add_argument("--max-scans", type=count(1), help="build only the first N volumes")
    p.add_argument("--cache-dir", default=None, help="download cache (default: the HF cache)")
    p.add_argument("--endpoint", default=None, help="hub URL (default: HF_ENDPOINT or the hub)")
    p.add_argument("--delete-after-commit", action="store_true", help="free disk as it goes")
    p.add_argument("--store", default=defaults.STORE, help="Zarr store folder or URL")
    p.add_argument("--dagster-home", default=defaults.DAGSTER_HOME)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
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
    with (
        hold_home(home, "hub"),
        output_to(log) as terminal,
        progress_display(None, terminal) as progress,
    ):
        rows = run_hub(config, args.store, home, progress)
    print_summary(rows, sys.stdout)
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} runs succeeded; full log {log}")
    return 1 if failed else 0
