"""Build runs for many partitions: consecutive partitions share one run (a partition range),
as many per run as a backfill takes (the assets' backfill policy, applied by the build
queue), so 50,000 new scans are a few hundred runs, not 50,000."""

import hashlib
from collections.abc import Callable, Sequence

import dagster as dg

# Dagster's tags for a run over a range of partitions (what a batched backfill run carries).
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
REASON = "zarrfeed/reason"


def batched_requests(
    job_name: str,
    family: str,
    runs: Sequence[Sequence[tuple[str, str]]],
    salt: Callable[[str], str],
) -> list[dg.RunRequest]:
    """Run requests of ``job_name``, one per run of (key, why) partitions (consecutive keys,
    ``zarrfeed.jobs.queue.BuildQueue.release``): a partition range, a lone key a
    one-partition run.  A run's key covers its keys, their reasons and ``salt(key)`` (what
    makes a request new)."""
    out = []
    for run in runs:
        keys = [k for k, _ in run]
        facts = "\0".join(f"{k}\0{why}\0{salt(k)}" for k, why in run)
        run_key = (
            f"{family}:{keys[0]}..{keys[-1]}:{hashlib.sha256(facts.encode()).hexdigest()[:12]}"
        )
        tags = {REASON: "; ".join(dict.fromkeys(why for _, why in run))}
        if len(run) == 1:
            out.append(dg.RunRequest(job_name=job_name, partition_key=keys[0], run_key=run_key,
                                     tags=tags))  # fmt: skip
        else:
            tags.update({RANGE_START: keys[0], RANGE_END: keys[-1]})
            out.append(dg.RunRequest(job_name=job_name, run_key=run_key, tags=tags))
    return out
