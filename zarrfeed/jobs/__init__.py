"""Jobs and the sensor that turns new raw files into partitions and runs."""

import dagster as dg

from zarrfeed.assets.partitions import ct_scans
from zarrfeed.resources import RawFolderResource

ct_build = dg.define_asset_job("ct_build", selection=dg.AssetSelection.groups("ct"))


@dg.sensor(job=ct_build, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def ct_scan_discovery(context: dg.SensorEvaluationContext, raw: RawFolderResource):
    """Every new CT file under the raw folder becomes a partition and gets a build run."""
    found = raw.ct_scans()
    known = set(context.instance.get_dynamic_partitions(ct_scans.name))
    new = sorted(set(found) - known)
    gone = sorted(known - set(found))
    if gone:
        context.log.warning(f"{len(gone)} CT partitions have no raw file any more: {gone[:20]}")
    if not new:
        return dg.SkipReason(f"no new CT files among {len(found)} under {raw.root}")
    return dg.SensorResult(
        run_requests=[dg.RunRequest(partition_key=k, run_key=f"ct:{k}") for k in new],
        dynamic_partitions_requests=[ct_scans.build_add_request(new)],
    )
