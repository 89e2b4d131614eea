"""The README's main command, ``zarrfeed demo``, on the sample data plus the CT sources and
faults of issue 13; ``dg launch`` against the instance it leaves behind (no retraining when no
data changed); and ``dg dev`` on that instance training a model, with no click, after a new
raw image set appears."""

import contextlib
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from dagsterdev import start_dagster_dev, wait_for

# The session's demo build (~3 min on 2 cores) counts against the first test that uses it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
BIN = Path(sys.executable).parent
FAULTS = {  # key -> the file its one-line failure names
    "all_air": "all_air.nii.gz",
    "hostile": "hostile.nii",
    "twin_scan": "twin scan.nii.gz",
}
SOURCES = ["ct-sources_dicom_patient_1_CT", "scaled_1", "volume_1"]
SUPERSEDED = re.compile(r"(Deprecation|Supersession)Warning")  # what the documented commands avoid


def instance_at(home: str):
    os.environ["DAGSTER_HOME"] = home
    try:
        return dg.DagsterInstance.get()
    finally:
        del os.environ["DAGSTER_HOME"]


def test_demo_summary_tells_each_failure_in_one_line(demo):
    _, env, out = demo
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # three bad items
    assert out.stderr == "", out.stderr[-2000:]  # Dagster's logs went to the log file
    assert "16/19 runs succeeded" in out.stdout
    assert "DEBUG" not in out.stdout and "DagsterExecutionStepExecutionError" not in out.stdout
    table = out.stdout.partition("ct all_air failed")[0]
    assert re.search(r"^ct\s+all_air\s+NO", table, re.M)
    for key, name in FAULTS.items():
        [line] = [ln for ln in out.stdout.splitlines() if ln.startswith(f"ct {key} failed: ")]
        assert name in line, line
    for key in SOURCES:
        assert re.search(rf"^ct\s+{re.escape(key)}\s+yes", table, re.M), key
    assert re.search(r"^training\s+defect_segmentation_model\s+yes.*iou 0\.00 -> 0\.[1-9]",
                     out.stdout, re.M)  # fmt: skip
    log = re.search(r"full log (\S+)", out.stdout).group(1)
    assert Path(log).is_file() and "DEBUG" in Path(log).read_text()
    # the printed command names the instance absolutely and runs without warnings (below)
    command = out.stdout.strip().splitlines()[-1]
    assert f"DAGSTER_HOME={env['DAGSTER_HOME']} " in command and " dev -w " in command
    from zarrfeed.store import ZarrStore

    keys = ZarrStore(env["ZARRFEED_STORE"]).read_manifest("ct")["keys"]
    assert set(SOURCES) <= set(keys) and not set(FAULTS) & set(keys)
    with instance_at(env["DAGSTER_HOME"]) as instance:
        model = instance.get_latest_materialization_event(dg.AssetKey("defect_segmentation_model"))
    meta = model.asset_materialization.metadata
    assert meta["eval_iou"].value > 0.1 > meta["eval_iou_before"].value  # it finds defects


def launch(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [BIN / "dg", "launch", "-m", "zarrfeed.definitions", *args]
    cli = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert not SUPERSEDED.search(cli.stderr), cli.stderr[-3000:]
    return cli


def test_dg_launch_materialises_a_partition_and_unchanged_data_retrains_nothing(demo):
    tmp, env, _ = demo
    from zarrfeed.definitions import defs as code_location

    defs = code_location()
    with instance_at(env["DAGSTER_HOME"]) as instance:
        before = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        runs = len(instance.get_runs())
    # one asset, one asset of the subsettable ct_derived step, then the README's command
    # (a job: `--assets group:ct` makes dagster print a BetaWarning of its own)
    launch(env, tmp, "--assets", "image_store", "--partition", "inspection_test")
    launch(env, tmp, "--assets", "ct_sparse", "--partition", "train_1_a_1")
    launch(env, tmp, "--job", "ct_build", "--partition", "train_1_a_1")  # the README's
    with instance_at(env["DAGSTER_HOME"]) as instance:
        for asset, n in (("ct_windows", 7), ("spike_voxels", 2), ("image_patches", 2)):
            assert len(instance.get_materialized_partitions(dg.AssetKey(asset))) == n
        new = instance.get_runs(limit=3)
        assert len(instance.get_runs()) == runs + 3 and all(r.is_success for r in new)
        records = instance.get_records_for_run(new[1].run_id).records
        made = {r.event_log_entry.dagster_event.asset_key for r in records
                if r.event_log_entry.is_dagster_event
                and r.event_log_entry.dagster_event.is_step_materialization}  # fmt: skip
        assert made == {dg.AssetKey("ct_sparse")}  # the subset alone
        # every partition was reused: no manifest refresh, no model retrains
        after = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, cursor=before.cursor
        )
        requested = {k for k in defs.resolve_asset_graph().get_all_asset_keys()
                     if after.get_num_requested(k)}  # fmt: skip
        assert requested == set(), requested


def test_a_new_raw_image_set_ends_in_a_trained_model_without_a_click(demo):
    tmp, env, _ = demo
    model = dg.AssetKey("defect_segmentation_model")
    with instance_at(env["DAGSTER_HOME"]) as instance:
        before = instance.get_latest_materialization_event(model).run_id
    with start_dagster_dev(env, tmp / "dagster_dev.log"):
        # a new inspection set: discovery → images_build → images_dataset → the model
        raw = Path(env["ZARRFEED_RAW"]) / "inspection"
        shutil.copytree(raw / "test", raw / "extra")

        def retrained():
            with instance_at(env["DAGSTER_HOME"]) as instance:
                event = instance.get_latest_materialization_event(model)
                if event.run_id != before and instance.get_run_by_id(event.run_id).is_finished:
                    return event
                return None

        log = (tmp / "dagster_dev.log").read_text
        try:
            event = wait_for(retrained, 420, "defect_segmentation_model to be retrained")
        except AssertionError:
            raise AssertionError(log()[-4000:]) from None
        assert not SUPERSEDED.search(log()), log()[-4000:]
    with instance_at(env["DAGSTER_HOME"]) as instance:
        run = instance.get_run_by_id(event.run_id)
        assert run.is_success and run.tags.get("dagster/from_automation_condition") == "true"
        assert "inspection_extra" in instance.get_dynamic_partitions("image_sets")
        meta = event.asset_materialization.metadata
        trained_on = {r.data["what"]: r.data["value"] for r in meta["trained_on"].records}
        assert trained_on["partitions"] == "3"  # the new set is in the manifest
        assert meta["eval_iou"].value > 0.1  # the automated run trains with the task's defaults


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_demo_in_a_terminal_shows_its_bar_only_and_ctrl_c_one_line(demo, tmp_path):
    """In a real terminal (a pseudo-terminal here), Dagster's logs go to demo.log, never
    between the bar's redraws; Ctrl-C after the first run prints one line.  The demo's raw
    data is reused with a fresh store and instance, and stopped once one run is done."""
    _, env, _ = demo
    home = tmp_path / "home"
    args = [str(BIN / "zarrfeed"), "demo", "--raw", env["ZARRFEED_RAW"],
            "--store", str(tmp_path / "store.zarr"), "--dagster-home", str(home)]  # fmt: skip
    run_env = {**env, "DAGSTER_HOME": str(home), "ZARRFEED_MODELS": str(tmp_path / "models"),
               "COLUMNS": "120", "LINES": "40"}  # fmt: skip
    pid, fd = pty.fork()
    if pid == 0:  # the child: the demo, its terminal the pseudo-terminal
        os.chdir(tmp_path)
        os.execve(args[0], args, run_env)
    out, interrupted_at, deadline = bytearray(), None, time.monotonic() + 300
    log = home / "demo.log"
    try:
        while time.monotonic() < deadline:
            if interrupted_at is None and log.exists() and "RUN_SUCCESS" in log.read_text():
                interrupted_at = len(out)
                os.write(fd, b"\x03")  # Ctrl-C as a terminal sends it: to the whole group
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the demo exited and closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
        _, status = os.waitpid(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    text = ANSI.sub("", out.decode(errors="replace"))
    assert interrupted_at is not None, text[-3000:]
    assert os.waitstatus_to_exitcode(status) == 130, text[-3000:]
    assert "━" in text  # the progress bar: the terminal path, not the piped one
    assert " - DEBUG - " not in text and "Traceback" not in text, text[-3000:]
    after = ANSI.sub("", out[interrupted_at:].decode(errors="replace"))
    lines = [ln.strip() for ln in re.split(r"[\r\n]", after)]
    said = [ln for ln in lines if ln and ln != "^C" and "━" not in ln]
    assert said == ["zarrfeed demo: interrupted"], said
    logged = log.read_text()
    for event in ("STEP_START", "ASSET_MATERIALIZATION", "RUN_SUCCESS", " - DEBUG - "):
        assert event in logged, event  # Dagster's full logs
