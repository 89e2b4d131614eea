"""The README's main command, ``zarrfeed demo``, on the sample data plus the CT sources and
faults of issue 13; ``dg launch`` against the instance it leaves behind (no retraining when no
data changed); ``zarrfeed inspect`` and ``status`` reading it, and a typo partition made in
the UI failing in one line, reported, and removed with one command; then one ``dg dev`` on
that instance, started once a new raw image set has appeared: a person in a real browser
(headless Debian Chromium driven by Playwright) materialises a ``ct_windows`` partition from
the UI and sees its preview (three oriented views per window, at least 256 px each), each
scan's check result on its own, ``ct_hu``'s spacing, shape and HU percentiles and the demo's
runs re-executable as the UI's own, while the daemon's discovery sensor builds the new set and
its automation trains a model on it with no click; a run submitted through the webserver's
GraphQL API rebuilds a partition.  Screenshots are saved for a person to look at (CI keeps
``screenshots/``).

The tests share the instance and run in this order, on one worker (pytest-xdist distributes
by file): the ones before ``dg dev`` count runs and partitions that its daemon would add to."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from dagsterdev import start_dagster_dev, wait_for
from PIL import Image
from test_cli import zarrfeed

from zarrfeed.commands.sample_data import DEMO_SCANS
from zarrfeed.datasets import read_manifest
from zarrfeed.samples import make_inspection

# The session's demo build (~4 min on 2 cores) counts against the first test that uses it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
BIN = Path(sys.executable).parent
FAULTS = {  # key -> the file its one-line failure names
    "all_air": "all_air.nii.gz",
    "hostile": "hostile.nii",
    "twin_scan": "twin scan.nii.gz",
}
SOURCES = ["ct-sources_dicom_patient_1_CT", "scaled_1", "volume_1"]
GOOD_SCANS = DEMO_SCANS + len(SOURCES)  # the sample data's scans and the other sources
SUPERSEDED = re.compile(r"(Deprecation|Supersession)Warning")  # what the documented commands avoid
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(os.environ.get("ZARRFEED_SCREENSHOTS", Path(__file__).parents[1] / "screenshots"))
KEY = "train_1_a_1"
VIEW_PX = 256  # a preview's view, at least, on its longer side
MODEL = dg.AssetKey("defect_segmentation_model")


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
    ran = re.search(r"^(\d+)/(\d+) runs succeeded", out.stdout, re.M)
    assert ran and int(ran[2]) - int(ran[1]) == len(FAULTS), out.stdout[-3000:]  # theirs alone
    assert "DEBUG" not in out.stdout and "DagsterExecutionStepExecutionError" not in out.stdout
    table = out.stdout.partition("ct all_air failed")[0]
    assert re.search(r"^ct\s+all_air\s+NO", table, re.M)
    for key, name in FAULTS.items():
        [line] = [ln for ln in out.stdout.splitlines() if ln.startswith(f"ct {key} failed: ")]
        assert name in line, line
    for key in SOURCES:
        assert re.search(rf"^ct\s+{re.escape(key)}\s+yes", table, re.M), key
    assert re.search(r"^training\s+defect_segmentation_model\s+yes", table, re.M)
    assert re.search(r"^defect_segmentation_model\s+IoU 0\.00 -> 0\.[1-9]", out.stdout, re.M)
    # the classifier: its held-out AUROC, never its accuracy over 18 rare findings
    assert re.search(r"^ct_classifier_model\s+(did not learn: )?AUROC \d", out.stdout, re.M)
    assert "accuracy" not in out.stdout
    log = re.search(r"full log (\S+)", out.stdout).group(1)
    assert Path(log).is_file() and "DEBUG" in Path(log).read_text()
    # the printed command names the instance absolutely and runs without warnings (below)
    command = out.stdout.strip().splitlines()[-1]
    assert f"DAGSTER_HOME={env['DAGSTER_HOME']} " in command and " dev -w " in command
    from zarrfeed.store import ZarrStore

    keys = read_manifest(ZarrStore(env["ZARRFEED_STORE"]), "ct")["keys"]
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
        for asset, n in (("ct_windows", GOOD_SCANS), ("spike_voxels", 2), ("image_patches", 2)):
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


def test_inspect_and_status_read_the_demo(demo, tmp_path):
    _, env, _ = demo
    out = zarrfeed("inspect", env=env)  # piped: plain text
    assert out.returncode == 0 and "\x1b[" not in out.stdout
    assert any(
        ln.split()[:3] == ["ct_windows", "ct/windows", str(GOOD_SCANS)]
        for ln in out.stdout.splitlines()
    )
    tty = subprocess.run(  # in a terminal: a rich table
        ["script", "-qec", f"{BIN / 'zarrfeed'} inspect", "/dev/null"],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert "┏" in tty.stdout and "ct_windows" in tty.stdout, tty.stdout[-2000:]
    rows = json.loads(zarrfeed("inspect", "ct_windows", "--json", env=env).stdout)
    assert {r["key"] for r in rows} >= {"train_1_a_1", "volume_1"}
    one = zarrfeed("inspect", "ct_windows", "train_1_a_1", "--previews", tmp_path, env=env)
    assert one.returncode == 0, one.stderr
    assert "blosc" in one.stdout and "source:" in one.stdout and "window_range ok" in one.stdout
    with Image.open(tmp_path / "ct_windows_train_1_a_1.png") as png:  # 3 windows × 3 views
        assert png.width > 3 * 128 and png.height > 3 * 128
    wrong = zarrfeed("inspect", "ct_window", env=env)
    assert wrong.returncode == 2 and "ct_windows" in wrong.stderr  # names what exists

    status = zarrfeed("status", env=env)
    assert status.returncode == 1  # the demo's three bad items
    lines = status.stdout.splitlines()
    failed = {ln.split()[2]: ln for ln in lines if ln.split()[1:2] == ["failed"]}
    assert "all_air.nii.gz" in failed["all_air"] and "hostile.nii" in failed["hostile"]
    assert any(ln.split()[1:3] == ["conflict", "twin_scan"] for ln in lines)
    report = json.loads(zarrfeed("status", "--json", env=env).stdout)
    assert {f["family"] for f in report["families"]} == {"ct", "spike", "images"}


def test_a_typo_partition_fails_in_one_line_is_reported_and_removed(demo):
    tmp, env, _ = demo
    with instance_at(env["DAGSTER_HOME"]) as instance:
        instance.add_dynamic_partitions("ct_scans", ["train_9_z_9"])  # the UI's "Add a partition"
    cmd = [BIN / "dg", "launch", "-m", "zarrfeed.definitions", "--job", "ct_build",
           "--partition", "train_9_z_9"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    assert run.returncode != 0
    assert "no raw ct item 'train_9_z_9'" in run.stderr
    assert "zarrfeed partitions remove ct train_9_z_9" in run.stderr

    status = zarrfeed("status", env=env).stdout
    [line] = [ln for ln in status.splitlines() if "train_9_z_9" in ln]
    assert "zarrfeed partitions remove ct train_9_z_9" in line

    asked = zarrfeed("partitions", "remove", "ct", "train_9_z_9", env=env)
    assert asked.returncode == 2 and "--yes" in asked.stderr  # no terminal to ask on
    done = zarrfeed("partitions", "remove", "ct", "train_9_z_9", "--yes", env=env)
    assert done.returncode == 0, done.stderr
    with instance_at(env["DAGSTER_HOME"]) as instance:
        assert "train_9_z_9" not in instance.get_dynamic_partitions("ct_scans")
    again = zarrfeed("partitions", "remove", "ct", "train_9_z_9", "--yes", env=env)
    assert again.returncode == 2 and "no ct partition 'train_9_z_9'" in again.stderr
    kept = zarrfeed("partitions", "remove", "ct", "train_1_a_1", "--yes", env=env)
    assert kept.returncode == 2 and "has a raw source" in kept.stderr


@pytest.fixture(scope="module")
def dev(demo):
    """One ``dg dev`` (webserver and daemon) on the demo's instance for every test below,
    started once a new raw inspection set has appeared: (port, its log, the run id of the
    model's latest materialisation before)."""
    tmp, env, _ = demo
    with instance_at(env["DAGSTER_HOME"]) as instance:
        before = instance.get_latest_materialization_event(MODEL).run_id
    # a new inspection set (new images: a copy of a set would be withheld as a duplicate):
    # discovery → images_build → images_dataset → the model
    made = list(make_inspection(tmp / "new_set", 4, np.random.default_rng(99)))
    (Path(env["ZARRFEED_RAW"]) / "inspection" / "extra").mkdir()
    for path in made:
        shutil.move(path, Path(env["ZARRFEED_RAW"]) / "inspection" / "extra" / path.name)
    log = tmp / "dagster_dev.log"
    with start_dagster_dev(env, log) as port:
        yield port, log, before


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: setup.sh installs it (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} is missing: sudo apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def ui(dev, browser):
    """(base URL, page): the module's ``dg dev`` in one browser page."""
    port, _, _ = dev
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(60_000)
    dismiss = page.get_by_role("button", name="Skip")  # the first-visit newsletter dialog
    page.add_locator_handler(page.get_by_text("Join the Dagster community"), dismiss.click)
    yield f"http://127.0.0.1:{port}", page
    page.close()


@pytest.mark.browser
def test_materialise_a_ct_windows_partition_from_the_ui_and_see_its_preview(ui):
    url, page = ui
    page.goto(f"{url}/assets", wait_until="networkidle")
    page.locator(".CodeMirror").first.click()  # the catalog's search box
    page.keyboard.type("ct_windows")
    page.keyboard.press("Enter")
    page.keyboard.press("Escape")
    link = page.locator('a[href="/assets/ct_windows"]').first
    link.wait_for()
    page.screenshot(path=SHOTS / "1_catalog_search.png")
    link.dispatch_event("click")  # the search suggestions' popper overlaps the row
    page.wait_for_url("**/assets/ct_windows")

    page.get_by_role("button", name="Materialize…").click()
    page.locator(".dagster-dialog").get_by_text("Select a partition or create one").click()
    page.keyboard.type(KEY)
    page.locator(".dagster-popover").locator("span", has_text=KEY).first.click()
    page.keyboard.press("Escape")
    page.screenshot(path=SHOTS / "2_materialize_dialog.png")
    page.get_by_role("button", name="Launch 1 run").click()

    page.get_by_role("link", name="View", exact=True).click()  # the "Launched run" toast
    page.wait_for_url("**/runs/**")
    page.get_by_text("Success", exact=True).first.wait_for(timeout=300_000)
    page.screenshot(path=SHOTS / "3_run_succeeded.png")

    page.goto(f"{url}/assets/ct_windows", wait_until="networkidle")
    latest = page.get_by_text("Latest materialization").locator("..")
    latest.get_by_text(KEY).wait_for()
    width, height, alt, dialog_text = open_preview(page, "4_preview.png")
    assert width >= 3 * VIEW_PX and height >= 3 * VIEW_PX // 2, (width, height)
    assert all(w in alt for w in ("lung", "mediastinum", "bone")) and KEY in alt, alt
    assert KEY in dialog_text
    page.keyboard.press("Escape")


def open_preview(page, shot: str) -> tuple[int, int, str, str]:
    """Open the latest materialisation's preview; (width, height, alt, dialog text)."""
    row = page.locator("tr", has=page.get_by_text("preview", exact=True))
    row.get_by_text("[Show Markdown]").first.click()
    image = page.locator(".dagster-dialog img").first
    image.wait_for()
    page.wait_for_function(
        "img => img.complete && img.naturalWidth > 0", arg=image.element_handle()
    )
    page.screenshot(path=SHOTS / shot)
    width, height = image.evaluate("img => [img.naturalWidth, img.naturalHeight]")
    return width, height, image.get_attribute("alt"), page.locator(".dagster-dialog").inner_text()


@pytest.mark.browser
def test_a_check_reports_each_scan_on_its_own(ui):
    url, page = ui
    page.goto(f"{url}/assets/ct_windows?view=checks", wait_until="networkidle")
    # The check's own Partitions tab renders after the asset's (a loaded machine shows the
    # gap): wait for the second before taking the last, or the asset's own tab is clicked.
    tabs = page.get_by_text("Partitions", exact=True)
    tabs.nth(1).wait_for()
    tabs.last.click()
    assert "view=checks" in page.url, page.url  # still on the check, not the asset's tab
    passed = page.get_by_text(re.compile(r"^Passed \(\d+\)$")).first
    passed.wait_for()
    assert int(re.search(r"\d+", passed.inner_text()).group()) >= GOOD_SCANS
    page.get_by_text(KEY, exact=True).first.click()  # one scan: its own result and metadata
    page.get_by_text("out_of_range", exact=True).first.wait_for()
    page.screenshot(path=SHOTS / "5_check_per_partition.png")
    detail = page.locator("body").inner_text()
    assert re.search(rf"{KEY}\s+Passed\s+Latest execution", detail), detail[-2000:]
    assert re.search(r"out_of_range\s+none", detail) and "{}" not in detail  # no empty JSON


@pytest.mark.browser
def test_ct_hu_shows_spacing_shape_percentiles_and_an_oriented_preview(ui):
    url, page = ui
    page.goto(f"{url}/assets/ct_hu", wait_until="networkidle")
    for label in ("spacing_zyx_mm", "shape_zyx", "orientation_zyx", "hu_percentiles"):
        page.get_by_text(label, exact=True).first.wait_for()
    text = page.locator("body").inner_text()
    assert re.search(r"p50\s+-?\d+", text) and "SAR" in text, text[-3000:]
    page.get_by_text("hu_percentiles", exact=True).first.scroll_into_view_if_needed()
    page.screenshot(path=SHOTS / "6_ct_hu_metadata.png")
    width, height, alt, _ = open_preview(page, "7_ct_hu_preview.png")
    assert width >= 3 * VIEW_PX and height >= VIEW_PX // 2 and "lung window" in alt


@pytest.mark.browser
@pytest.mark.parametrize("job", ["ct_build", "train"])
def test_a_demo_run_re_executes_as_the_uis_own(ui, demo, job):
    """No warning that the run was loaded from a different code location (or another
    version of its job): the demo's build runs and its training runs (an asset subset)."""
    url, page = ui
    _, env, _ = demo
    with instance_at(env["DAGSTER_HOME"]) as instance:
        [run] = [r for r in instance.get_runs() if r.job_name == job and r.is_success][-1:]
    page.goto(f"{url}/runs/{run.run_id}", wait_until="networkidle")
    button = page.get_by_role("button", name=re.compile("Re-execute"))
    button.first.wait_for()
    button.first.hover()
    page.wait_for_timeout(1000)  # a warning shows as an icon and a tooltip on hover
    page.screenshot(path=SHOTS / f"8_reexecute_{job}.png")
    assert button.first.is_enabled()
    assert page.locator('button [aria-label="warning"]').count() == 0
    body = page.locator("body").inner_text()
    assert "different code location" not in body and "may be different" not in body


@pytest.mark.browser
def test_the_classifier_page_shows_per_finding_auroc(ui):
    url, page = ui
    page.goto(f"{url}/assets/ct_classifier_model", wait_until="networkidle")
    label = page.get_by_text(re.compile(r"^\s*auroc_per_finding\s*$")).first
    label.wait_for()
    row = page.locator("tr", has=label).first
    text = row.inner_text()
    page.screenshot(path=SHOTS / "9_model_auroc.png", full_page=True)
    assert "Lung nodule" in text, text  # one row per finding, named
    scores = [float(s) for s in re.findall(r"\b[01](?:\.\d+)?\b", text)]
    assert len(scores) >= 2 and all(0 <= s <= 1 for s in scores), text


def test_a_new_raw_image_set_ends_in_a_trained_model_without_a_click(demo, dev):
    _, env, _ = demo
    _, log, before = dev

    def retrained():
        with instance_at(env["DAGSTER_HOME"]) as instance:
            event = instance.get_latest_materialization_event(MODEL)
            if event.run_id != before and instance.get_run_by_id(event.run_id).is_finished:
                return event
            return None

    try:
        event = wait_for(retrained, 420, "defect_segmentation_model to be retrained")
    except AssertionError:
        raise AssertionError(log.read_text()[-4000:]) from None
    assert not SUPERSEDED.search(log.read_text()), log.read_text()[-4000:]
    with instance_at(env["DAGSTER_HOME"]) as instance:
        run = instance.get_run_by_id(event.run_id)
        assert run.is_success and run.tags.get("dagster/from_automation_condition") == "true"
        assert "inspection_extra" in instance.get_dynamic_partitions("image_sets")
    # the discovery sensor launched the new set's build, found over the webserver's GraphQL
    built = [r for r in graphql_runs(dev[0], "inspection_extra") if r["jobName"] == "images_build"]
    assert any(r["status"] == "SUCCESS" for r in built), built
    with instance_at(env["DAGSTER_HOME"]) as instance:
        meta = event.asset_materialization.metadata
        trained_on = {r.data["what"]: r.data["value"] for r in meta["trained_on"].records}
        assert trained_on["partitions"] == "3"  # the new set is in the manifest
        assert meta["eval_iou"].value > 0.1  # the automated run trains with the task's defaults


RUNS_QUERY = """
query Runs($key: String!, $value: String!) {
  runsOrError(filter: {tags: [{key: $key, value: $value}]}) {
    ... on Runs { results { runId status jobName } }
  }
}"""
RANGE = ("dagster/asset_partition_range_start", "dagster/asset_partition_range_end")


def graphql_runs(port: int, key: str) -> list[dict]:
    """The runs that build partition ``key``, as the webserver's GraphQL API lists them: its
    own, or a batched run whose range starts or ends at it (the discovery sensor requests new
    sets as ranges of consecutive partitions)."""
    from dagster_graphql import DagsterGraphQLClient

    client = DagsterGraphQLClient("127.0.0.1", port_number=port)
    found = []
    for tag in ("dagster/partition", *RANGE):
        data = client._execute(RUNS_QUERY, {"key": tag, "value": key})
        found += data["runsOrError"]["results"]
    return found


def test_a_partition_run_launched_through_the_graphql_api_succeeds(demo, dev):
    """After the tests above (it rebuilds a partition they read): a forced run submitted
    through the webserver's GraphQL API really rebuilds and succeeds."""
    from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError

    from zarrfeed.store import ZarrStore

    _, env, _ = demo
    port, log, _ = dev
    client = DagsterGraphQLClient("127.0.0.1", port_number=port)
    store = ZarrStore(env["ZARRFEED_STORE"])
    before = store.commit_record("images/patches", "inspection_test")["version"]
    run_id = client.submit_job_execution(
        "images_build",
        tags={"dagster/partition": "inspection_test"},
        run_config={"resources": {"build": {"config": {"force": True}}}},
    )

    def finished():
        try:
            status = client.get_run_status(run_id).value
        except DagsterGraphQLClientError:
            return None
        return status if status in ("SUCCESS", "FAILURE", "CANCELED") else None

    assert wait_for(finished, 240, "the API run") == "SUCCESS", log.read_text()[-3000:]
    assert any(r["runId"] == run_id for r in graphql_runs(port, "inspection_test"))
    assert store.commit_record("images/patches", "inspection_test")["version"] != before
    assert {"inspection_test", "inspection_train"} <= set(store.list_partitions("images/patches"))
