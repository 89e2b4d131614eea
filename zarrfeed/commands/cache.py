"""``zarrfeed cache list|clear``: the shared training caches in shared memory, and the disk
tier that keeps chunks fetched from object stores (named ``disk``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DISK = "disk"  # the name of the disk tier among the caches


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cache", help="list or clear the shared training caches in /dev/shm and the disk tier"
    )
    p.add_argument("action", choices=["list", "clear"])
    p.add_argument(
        "names", nargs="*", help=f"caches to clear (as `list` names them; {DISK}: the disk tier)"
    )
    p.add_argument(
        "--all", action="store_true", help="clear every cache no process holds, and the disk tier"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from zarrfeed.store.disktier import DiskTier, tier_budget, tier_folder
    from zarrfeed.training.data.shm import clear_caches, list_caches, shm_root

    tier = DiskTier(tier_folder(), tier_budget()) if tier_folder().is_dir() else None
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
        if tier is not None:
            t = tier.stats()
            print(
                f"{DISK}  disk tier {int(t['bytes_held']) / 1e9:.3f} GB of "
                f"{tier.budget_bytes / 1e9:.3f} GB in {t['entries']} chunks  {t['folder']} "
                "(chunks fetched from object stores)"
            )
        return 0
    if not args.all and not args.names:
        print("zarrfeed cache clear: name caches to clear, or --all", file=sys.stderr)
        return 2
    names = [n for n in args.names if n != DISK]
    removed, busy = clear_caches(None if args.all else names) if args.all or names else ([], [])
    if tier is not None and (args.all or DISK in args.names):
        tier.clear()
        removed.append(DISK)
    print(
        f"removed {len(removed)} cache(s)" + (f"; in use, kept: {', '.join(busy)}" if busy else "")
    )
    unknown = [n for n in names if n not in removed and n not in busy]
    if unknown:
        print(f"zarrfeed cache clear: no cache named {', '.join(unknown)} "
              "(`zarrfeed cache list` names them)", file=sys.stderr)  # fmt: skip
        return 2
    return 0
