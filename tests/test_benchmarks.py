"""The benchmark scripts run and print well-formed BENCH lines (on small inputs)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_LINE = re.compile(r"^BENCH (\S+) (-?[0-9.]+(?:e[-+]?\d+)?) (x|s|MB|share|\S+)( .*)?$")
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def bench_names(script: str, *args: str) -> set[str]:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick", *args],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr[-4000:]}"
    out = done.stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("BENCH")]
    assert all(BENCH_LINE.match(ln) for ln in lines), lines
    return {BENCH_LINE.match(ln).group(1) for ln in lines}


@pytest.mark.slow
def test_transforms_benchmark_quick():
    assert {"transforms.sparse_vs_argwhere", "transforms.patch_index_memory_ratio",
            "transforms.window_vs_float64", "transforms.spike_bins_vs_loop"} <= bench_names(
        "transforms.py")  # fmt: skip


@pytest.mark.slow
def test_build_benchmark_quick():
    assert {"build.ct_scan_vs_naive", "build.ct_scan_seconds", "build.ct_dagster_fixed_s",
            "build.ct_scan_cpu_s", "build.dagster_overhead_s.single",
            "build.dagster_overhead_s.batched", "build.ct_backfill_vs_naive",
            "build.ct_backfill_runs", "build.dagster_overhead_per_partition_s",
            } <= bench_names("build.py")  # fmt: skip


@pytest.mark.slow
def test_loaders_benchmark_quick():
    names = bench_names("loaders.py")
    assert {
        "loader.cached_vs_mmap",
        "loader.cold_vs_zarr",
        "loader.disk_ratio",
        "loader.pss_mb",
        "loader.vs_monai",
        "loader.vs_torchio",
        "loader.init_10k_partitions_s",
        "loader.warm_vs_memcpy",
        "loader.ooc_vs_zarr",
        "loader.ooc_shm_peak_over_budget",
        "loader.ooc_decoded_over_dataset",
    } <= names


@pytest.mark.slow
def test_train_benchmark_quick():
    # One loader worker and batches of 2: the naive loader's measured steps start once the
    # batches in flight at the start are used up, and each of its samples costs many steps.
    names = bench_names("train.py", "--workers", "1", "--batch", "2")
    assert {"train.data_wait_share", "train.data_wait_share_naive"} <= names


@pytest.mark.slow
def test_gpu_benchmark_quick_on_the_cpu():
    regimes = ("fits", "device_quarter", "host_quarter", "augmented", "images")
    assert {
        "gpu.limit_samples_per_s",
        "gpu.vs_monai",
        "gpu.vs_monai.augmented",
        *(f"gpu.wait_share.{r}" for r in regimes),
        *(f"gpu.samples_vs_limit.{r}" for r in regimes),
    } <= bench_names("gpu.py", "--device", "cpu", "--repeat", "1")  # names, not figures
