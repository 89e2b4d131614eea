"""The benchmark scripts run and print well-formed BENCH lines (on small inputs)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_LINE = re.compile(r"^BENCH (\S+) (-?[0-9.]+(?:e[-+]?\d+)?) (x|s|MB|share|\S+)( .*)?$")


@pytest.mark.slow
def test_transforms_benchmark_quick():
    script = Path(__file__).parents[1] / "benchmarks" / "transforms.py"
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    lines = [ln for ln in out.splitlines() if ln.startswith("BENCH")]
    names = {BENCH_LINE.match(ln).group(1) for ln in lines}
    assert {"transforms.sparse_vs_argwhere", "transforms.patch_index_memory_ratio",
            "transforms.window_vs_float64", "transforms.spike_bins_vs_loop"} <= names  # fmt: skip
