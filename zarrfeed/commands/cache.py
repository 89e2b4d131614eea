"""``zarrfeed cache list|clear``: the shared training caches in shared memory."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cache", help="list or clear the shared training caches in /dev/shm")
    p.add_argument("action", choices=["list", "clear"])
    p.add_argument("names", nargs="*", help="caches to clear (as `list` names them)")
    p.add_argument("--all", action="store_true", help="clear every cache no process holds")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
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
