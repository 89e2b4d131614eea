"""Build benchmarks: the whole CT branch per scan vs seed 003's naive preprocessing, and
Dagster's per-partition overhead with one run per partition vs batched runs.

    python benchmarks/build.py            # a 512×512×300 CT-RATE-class scan, 100 partitions
    python benchmarks/build.py --quick    # small inputs (CI smoke run)
"""

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import dagster as dg
import numpy as np
from _bench import bench, ratio

from zarrfeed.assets import ct_assets
from zarrfeed.assets.build import Built, materialize_partitions, partitioned_asset, report
from zarrfeed.assets.partitions import ct_scans
from zarrfeed.definitions import RESOURCES
from zarrfeed.formats.discover import find_ct_scans, read_ct_rate_metadata, rescale_from_metadata
from zarrfeed.resources import CTSettings, RawFolderResource, ZarrStoreResource
from zarrfeed.samples import make_ct_rate
from zarrfeed.transforms import ct

warnings.filterwarnings("ignore", category=dg.BetaWarning)
warnings.filterwarnings("ignore", message=".*varying BackfillPolicies")


def naive_ct_branch(path: Path, slope: float, intercept: float, out: Path) -> None:
    """Seed 003's way: float64 numpy, ``scipy.ndimage.zoom``, per-window float64 arithmetic,
    ``np.argwhere`` for occupancy, a Python loop for the patch filter, uncompressed .npy."""
    import nibabel as nib
    from scipy.ndimage import zoom

    img = nib.load(path)
    vol = np.asarray(img.dataobj).astype(np.float64).transpose(2, 1, 0)  # (z, y, x)
    if vol.min() > -500:
        vol = vol * slope + intercept
    sx, sy, sz = img.header.get_zooms()[:3]
    factors = [s / t for s, t in zip((sz, sy, sx), (1.5, 0.75, 0.75), strict=True)]
    hu = np.clip(zoom(vol, factors, order=1), -1024, 3071)
    np.save(out / "hu.npy", np.rint(hu).astype(np.int16))
    for name in ("lung", "mediastinum", "bone"):
        w = ct.get_window(name)
        win = np.clip((hu - w.lo) / (w.hi - w.lo), 0, 1)
        np.save(out / f"{name}.npy", win.astype(np.float16))
        cells = np.argwhere(win > 0.5) * 64 // np.array(win.shape)  # TRELLIS 64³ occupancy:
        grid = np.zeros((64, 64, 64), dtype=bool)  # ss[coords] = 1, then the occupied cells
        grid[tuple(cells.T)] = True
        np.save(out / f"{name}_sparse.npy", np.argwhere(grid).astype(np.uint16))
    body, keep = hu > -500, []
    for z in range(0, hu.shape[0] - 63, 64):
        for y in range(0, hu.shape[1] - 63, 64):
            for x in range(0, hu.shape[2] - 63, 64):
                if body[z : z + 64, y : y + 64, x : x + 64].mean() >= 0.25:
                    keep.append((z, y, x))
    np.save(out / "patches.npy", np.array(keep, dtype=np.uint16))


def ct_branch(work: Path, size: str) -> None:
    raw = work / "raw"
    path = next(make_ct_rate(raw / "ct-rate", 1, size, np.random.default_rng(0)))
    key = next(iter(find_ct_scans(raw)))
    slope, intercept = rescale_from_metadata(read_ct_rate_metadata(raw).get(key))
    resources = {
        **RESOURCES,
        "zarr_store": ZarrStoreResource(url=str(work / "store.zarr")),
        "raw": RawFolderResource(root=str(raw)),
        "ct_settings": CTSettings(),  # the defaults: CT-CLIP spacing, 3 windows, 64³ occupancy
    }
    with dg.instance_for_test(temp_dir=str(work / "home")) as instance:
        instance.add_dynamic_partitions(ct_scans.name, [key])
        t0 = time.perf_counter()
        result = dg.materialize(ct_assets, partition_key=key, resources=resources,
                                instance=instance)  # fmt: skip
        ours = time.perf_counter() - t0
    body = sum(m.metadata["seconds"].value for m in result.get_asset_materialization_events()
               for m in [m.materialization] if "seconds" in m.metadata)  # fmt: skip
    assert result.success and all(c.passed for c in result.get_asset_check_evaluations())
    (work / "naive").mkdir()
    t0 = time.perf_counter()
    naive_ct_branch(path, slope, intercept, work / "naive")
    base = time.perf_counter() - t0
    store = resources["zarr_store"].store()
    stored = sum(store.commit_record(a, key)["stored_bytes"]
                 for a in ("ct/hu", "ct/windows", "ct/sparse", "ct/patches"))  # fmt: skip
    npy = sum(p.stat().st_size for p in (work / "naive").iterdir())
    shape = CT_SHAPES[size]
    text = f"{shape} scan, HU + 3 windows + sparse + patch index, incl. Dagster run and checks"
    ratio("build.ct_scan_vs_naive", ours, base, text)
    bench("build.ct_scan_seconds", ours, "s", f"{shape} scan, whole CT branch, 1 run")
    ratio("build.ct_scan_compute_vs_naive", body, base,
          "asset-body compute + write only (no checks, no Dagster run)")  # fmt: skip
    bench(
        "build.ct_disk_ratio",
        npy / stored,
        "x",
        f"naive .npy {npy / 1e6:.0f} MB / store {stored / 1e6:.0f} MB",
    )


CT_SHAPES = {"small": "40x96x96", "full": "300x512x512"}
BODY_SECONDS: list[float] = []


@partitioned_asset(partitions_def=dg.DynamicPartitionsDefinition(name="bench"), group="bench",
                   code_version="1", checks=("non_empty",))  # fmt: skip
def bench_tiny(
    context: dg.AssetExecutionContext, zarr_store: ZarrStoreResource
) -> dg.MaterializeResult:
    """A small partition written through the store: what Dagster costs around it."""
    store = zarr_store.store()

    def one(key: str) -> Built:
        t0 = time.perf_counter()
        with store.write_partition("bench/tiny", key, {"fingerprint": key}) as w:
            w.write("a", np.full((64, 64), len(key), np.uint8), read="whole")
        seconds = time.perf_counter() - t0
        BODY_SECONDS.append(seconds)
        return Built(report(store, "bench/tiny", key, seconds), {"non_empty": (True, {})})

    return materialize_partitions(context, one)


def dagster_overhead(work: Path, n: int) -> None:
    keys = [f"p{i:04d}" for i in range(n)]
    resources = {"zarr_store": ZarrStoreResource(url=str(work / "tiny.zarr"))}
    results = {}
    with dg.instance_for_test(temp_dir=str(work / "home2")) as instance:
        instance.add_dynamic_partitions("bench", keys)
        for mode in ("single", "batched"):
            BODY_SECONDS.clear()
            t0 = time.perf_counter()
            if mode == "single":
                for k in keys:
                    dg.materialize(
                        [bench_tiny], partition_key=k, resources=resources, instance=instance
                    )
            else:
                for i in range(0, n, 16):  # BackfillPolicy.multi_run(16), as the daemon splits it
                    batch = keys[i : i + 16]
                    tags = {"dagster/asset_partition_range_start": batch[0],
                            "dagster/asset_partition_range_end": batch[-1]}  # fmt: skip
                    dg.materialize([bench_tiny], tags=tags, resources=resources, instance=instance)
            total = time.perf_counter() - t0
            results[mode] = (total - sum(BODY_SECONDS)) / n
    for mode, per in results.items():
        text = f"per partition, {n} partitions, in-process runs: run time - asset body time"
        bench(f"build.dagster_overhead_s.{mode}", per, "s", text)
    ratio("build.dagster_overhead_batched_vs_single", results["batched"], results["single"],
          "16 partitions per run")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small inputs (smoke run)")
    args = parser.parse_args()
    os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "home").mkdir()
        (work / "home2").mkdir()
        ct_branch(work, "small" if args.quick else "full")
        dagster_overhead(work, 20 if args.quick else 100)


if __name__ == "__main__":
    main()
