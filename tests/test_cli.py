"""The ``zarrfeed`` command as a person uses it: its help, the common mistakes, ``inspect``,
``verify`` and ``status`` (plain text when piped, ``--json`` for scripts), ``demo`` in a real
terminal.  Its commands on the demo's instance are tested in test_demo.py, which has that
instance."""

import contextlib
import json
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

import pytest

BIN = Path(sys.executable).parent


def zarrfeed(*args: object, env: dict | None = None, cwd: Path | None = None):
    return subprocess.run(
        [BIN / "zarrfeed", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def test_help_shows_examples_and_the_tasks():
    out = zarrfeed("--help")
    assert out.returncode == 0 and "examples:" in out.stdout and "``" not in out.stdout
    assert "zarrfeed status" in out.stdout and "zarrfeed partitions remove" in out.stdout
    wrong = zarrfeed("train", "--task", "segmentation")
    assert wrong.returncode == 2
    assert "defect_segmentation" in wrong.stderr and "ct_classifier" in wrong.stderr


def test_sample_data_never_overwrites_and_names_a_file(tmp_path):
    mine = tmp_path / "raw" / "train_1_a_1.nii.gz"
    mine.parent.mkdir()
    mine.write_bytes(b"the user's own scan")
    out = zarrfeed("sample-data", tmp_path / "raw")
    assert out.returncode == 2 and "not empty" in out.stderr and "--force" in out.stderr
    assert mine.read_bytes() == b"the user's own scan"
    (tmp_path / "a_file").write_text("x")
    out = zarrfeed("sample-data", tmp_path / "a_file")
    assert out.returncode == 2 and "is a file" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_nightly_and_verify_on_an_images_store(dagster_env):
    """The nightly never calls a typo partition current; verify names a changed chunk and a
    changed source."""
    from datetime import datetime

    import dagster as dg
    from graph import build, discover
    from graph import schedule as nightly_of

    raw, resources, instance = dagster_env
    shutil.rmtree(raw / "ct-rate")
    shutil.rmtree(raw / "gopro-spike")
    for key in discover(instance, resources, "images"):
        assert build(resources, instance, "images", key).success
    instance.add_dynamic_partitions("image_sets", ["inspection_tset"])  # a typo in the UI
    schedule = nightly_of(resources, "images_nightly")
    # The context opens its own instance from the reference: closed with the block, so the
    # instance's definitions-state storage is not left current for the tests after this one.
    with dg.build_schedule_context(
        instance=instance, resources=resources, scheduled_execution_time=datetime(2026, 1, 1)
    ) as context:
        result = schedule.evaluate_tick(context)
    assert not result.run_requests and "inspection_tset" in result.skip_message
    assert "all" not in result.skip_message and "zarrfeed status" in result.skip_message
    store_url = resources["zarr_store"].url
    env = {**os.environ, "ZARRFEED_STORE": store_url}
    ok = zarrfeed("verify", env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "0 mismatched, 0 unverified" in ok.stdout

    store = resources["zarr_store"].store()
    images = store.read_array("images/images", "inspection_test", "images").copy()
    with store.write_partition("images/images", "inspection_test", store.commit_record(
        "images/images", "inspection_test")["attrs"]) as w:  # fmt: skip
        images[0, 0, 0, 0] ^= 1  # one bit flipped
        w.write("images", images)
    png = next((raw / "inspection" / "test").glob("*.png"))
    png.write_bytes(png.read_bytes() + b"\0")  # the source changed too
    bad = zarrfeed("verify", "image_store", env=env)
    assert bad.returncode == 1
    [line] = [ln for ln in bad.stdout.splitlines() if "inspection_test" in ln]
    assert "MISMATCH" in line and "images: content checksum differs" in line
    assert f"{raw / 'inspection' / 'test'} changed since the build" in line


def test_a_mistyped_store_or_an_unwritable_path_fails_in_one_line(tmp_path):
    """A store that does not exist is not an empty store: read as one, `status` would call
    every partition gone and advise removing them."""
    typo = tmp_path / "data" / "zarrfeed.zar"
    for args in (["status"], ["inspect"], ["verify"], ["partitions", "remove", "ct", "k", "--yes"]):
        out = zarrfeed(*args, "--store", typo)
        assert out.returncode == 2, (args, out.stdout, out.stderr[-2000:])
        assert f"no zarrfeed store at {typo}" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "empty").mkdir()
    home = tmp_path / "home"
    out = zarrfeed("demo", "--raw", tmp_path / "empty", "--store", tmp_path / "s.zarr",
                   "--dagster-home", home, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"{tmp_path / 'empty'}: expected raw CT scans" in out.stderr
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    out = zarrfeed("sample-data", blocker / "raw")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert str(blocker) in out.stderr


def test_a_second_demo_on_one_dagster_home_is_refused_in_one_line(tmp_path):
    """Two demos creating one instance at once break its SQLite storage (the second died on
    "dynamic partitions table ... dagster instance migrate"): while one holds the home, the
    next is refused by the home and the holder's pid; once the holder is killed, it runs."""
    home, raw = (tmp_path / "home").resolve(), tmp_path / "empty"
    raw.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from zarrfeed.commands.instance import hold_home; h = hold_home(Path(sys.argv[1]), "
         "'demo'); print('held', flush=True); time.sleep(600)", str(home)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        out = zarrfeed("demo", "--raw", raw, "--store", tmp_path / "s.zarr",
                       "--dagster-home", home, cwd=tmp_path)  # fmt: skip
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr[-2000:]
        assert (
            f"zarrfeed demo: the Dagster home {home} is in use by zarrfeed demo, pid "
            in (out.stderr)
            and f"pid {holder.pid} on " in out.stderr
        )
        assert "migrate" not in out.stderr and not (home / "dagster.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    out = zarrfeed("demo", "--raw", raw, "--store", tmp_path / "s.zarr",
                   "--dagster-home", home, cwd=tmp_path)  # fmt: skip
    assert f"{raw}: expected raw CT scans" in out.stderr  # past the hold: the empty raw folder


def test_the_one_line_cause_is_the_message_that_names_the_file():
    from types import SimpleNamespace as Error

    from zarrfeed.errors import root_cause

    gzip = Error(cls_name="BadGzipFile", message="BadGzipFile: stream ended early", cause=None)
    ours = Error(
        cls_name="InputError",
        cause=gzip,
        message="zarrfeed.errors.InputError: /raw/a.nii.gz: expected a complete gzip",
    )
    step = Error(cls_name="DagsterExecutionStepExecutionError", cause=ours,
                 message="Error occurred while executing op")  # fmt: skip
    assert root_cause(step) == "/raw/a.nii.gz: expected a complete gzip"
    assert root_cause(Error(cls_name="OSError", message="OSError: disk full", cause=None)) == (
        "disk full"
    )
    checks = Error(cls_name="DagsterAssetCheckFailedError", cause=None,
                   message="1 blocking asset check failed with ERROR severity:\n"
                           "ct_dataset: non_empty")  # fmt: skip
    assert root_cause(checks) == (
        "1 blocking asset check failed with ERROR severity: ct_dataset: non_empty"
    )


@pytest.mark.slow
def test_a_missing_raw_folder_is_reported_per_family_and_fails_verify(built, tmp_path):
    """The catalog still lists every item when the raw folder moves away: `status` must
    not call the partitions current, and `verify` must not exit 0 on sources it never read."""
    store, raw = built
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    env["ZARRFEED_STORE"] = str(store.url)
    moved = raw.with_name("raw.moved")
    raw.rename(moved)
    try:
        status = zarrfeed("status", "--json", env=env, cwd=tmp_path)
        verify = zarrfeed("verify", "ct_hu", env=env, cwd=tmp_path)
    finally:
        moved.rename(raw)
    assert status.returncode == 1, status.stdout + status.stderr
    problems = json.loads(status.stdout)["problems"]
    gone = [p for p in problems if p["state"] == "no source"]
    assert {p["family"] for p in gone} == {"ct", "spike", "images"}, gone
    for problem in gone:
        assert problem["why"] == f"the raw folder {raw} is missing", problem
        assert "put it back where it was" in problem["fix"]
        assert f"zarrfeed partitions remove {problem['family']} " in problem["fix"]
    assert not any(p["state"] in ("missing", "stale") for p in problems)  # no futile launch
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert f"source: the raw folder {raw} is missing" in verify.stdout
    assert "0 mismatched" in verify.stdout and "unverified" in verify.stdout
    ok = zarrfeed("verify", "ct_hu", env=env, cwd=tmp_path)  # the folder is back
    assert ok.returncode == 0, ok.stdout + ok.stderr

    scan = next(raw.rglob("train_1_a_1.nii.gz"))  # one source file gone: that partition only
    scan.rename(tmp_path / scan.name)
    try:
        status = zarrfeed("status", "--json", env=env, cwd=tmp_path)
    finally:
        (tmp_path / scan.name).rename(scan)
    gone = [p for p in json.loads(status.stdout)["problems"] if p["state"] == "no source"]
    assert [(p["family"], p["keys"], p["why"]) for p in gone] == [
        ("ct", ["train_1_a_1"], f"{scan} is missing")
    ]
    assert gone[0]["fix"].endswith("zarrfeed partitions remove ct train_1_a_1")


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.mark.slow
def test_demo_in_a_terminal_shows_its_bar_only_and_ctrl_c_one_line(sample_dir, tmp_path):
    """In a real terminal (a pseudo-terminal here), Dagster's logs go to demo.log, never
    between the bar's redraws; Ctrl-C after the first run prints one line.  The demo runs on
    the sample data with a fresh store and instance, and is stopped once one run is done."""
    raw = tmp_path / "raw"
    shutil.copytree(sample_dir, raw)
    home = tmp_path / "home"
    args = [str(BIN / "zarrfeed"), "demo", "--raw", str(raw),
            "--store", str(tmp_path / "store.zarr"), "--dagster-home", str(home)]  # fmt: skip
    run_env = {**os.environ, "DAGSTER_HOME": str(home), "ZARRFEED_RAW": str(raw),
               "ZARRFEED_STORE": str(tmp_path / "store.zarr"),
               "ZARRFEED_MODELS": str(tmp_path / "models"),
               "COLUMNS": "120", "LINES": "40"}  # fmt: skip
    pid, fd = pty.fork()
    if pid == 0:  # the child: the demo, its terminal the pseudo-terminal
        os.chdir(tmp_path)
        # As a shell starts a foreground job: Ctrl-C at its default.  An xdist worker runs
        # with SIGINT ignored, and an ignored signal stays ignored across exec.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
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
    import dagster as dg

    from zarrfeed.jobs.liveness import IN_PROGRESS

    with dg.DagsterInstance.from_config(str(home)) as instance:  # the run in flight stopped
        assert instance.get_runs_count(dg.RunsFilter(statuses=IN_PROGRESS)) == 0
