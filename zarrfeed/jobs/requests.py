"""Build runs for many partitions: consecutive partitions share one run (a partition range),
as many per run as a backfill takes (the assets' backfill policy), so 50,000 new scans are
a few thousand runs in the queue, not 50,000."""

import hashlib
from collections.abc import Callable, Sequence

import dagster as dg

from zarrfeed.assets.build import BATCH
from zarrfeed.batching import ranges

# Dagster's tags for a run over a range of partitions (what a batched backfill run carries).
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
REASON = "zarrfeed/reason"


def batched_requests(
    job_name: str,
    family: str,
    order: Sequence[str],
    wanted: Sequence[tuple[str, str]],
    salt: Callable[[str], str],
) -> list[dg.RunRequest]:
    """Run requests of ``job_name`` building the ``wanted`` (key, why) partitions: each run
    a stretch of consecutive keys of ``order`` (the partitions' order), at most
    :data:`~zarrfeed.assets.build.BATCH`'s size; a lone key is a one-partition run.  A run's
    key covers its keys, their reasons and ``salt(key)`` (what makes a request new)."""
    why = dict(wanted)
    out = []
    for run in ranges(order, why, BATCH.max_partitions_per_run or 1):
        facts = "\0".join(f"{k}\0{why[k]}\0{salt(k)}" for k in run)
        run_key = f"{family}:{run[0]}..{run[-1]}:{hashlib.sha256(facts.encode()).hexdigest()[:12]}"
        tags = {REASON: "; ".join(dict.fromkeys(why[k] for k in run))}
        if len(run) == 1:
            out.append(dg.RunRequest(job_name=job_name, partition_key=run[0], run_key=run_key,
                                     tags=tags))  # fmt: skip
        else:
            tags.update({RANGE_START: run[0], RANGE_END: run[-1]})
            out.append(dg.RunRequest(job_name=job_name, run_key=run_key, tags=tags))
    return out
