"""The README's main command, ``zarrfeed demo``, and the ``dagster asset materialize`` CLI
against the instance it leaves behind."""

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def test_demo_builds_everything_and_the_cli_materialises_a_partition(tmp_path):
    home, store = tmp_path / "home", tmp_path / "store.zarr"
    demo = subprocess.run(
        [
            BIN / "zarrfeed",
            "demo",
            "--raw",
            str(tmp_path / "raw"),
            "--store",
            str(store),
            "--dagster-home",
            str(home),
        ],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=tmp_path,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "9/9 runs succeeded" in demo.stdout
    assert "NO" not in demo.stdout.split("family", 1)[1]

    env = {**os.environ, "DAGSTER_HOME": str(home), "ZARRFEED_RAW": str(tmp_path / "raw"),
           "ZARRFEED_STORE": str(store)}  # fmt: skip
    cli = subprocess.run(
        [
            BIN / "dagster",
            "asset",
            "materialize",
            "-m",
            "zarrfeed.definitions",
            "--select",
            "image_store",
            "--partition",
            "inspection_test",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]

    os.environ["DAGSTER_HOME"] = str(home)
    try:
        with dg.DagsterInstance.get() as instance:
            for asset, n in (("ct_windows", 4), ("spike_voxels", 2), ("image_patches", 2)):
                assert len(instance.get_materialized_partitions(dg.AssetKey(asset))) == n
            assert instance.get_latest_materialization_event(dg.AssetKey("ct_dataset"))
            runs = instance.get_runs()
            assert len(runs) == 10 and all(r.is_success for r in runs)
    finally:
        del os.environ["DAGSTER_HOME"]
