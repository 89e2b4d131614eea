"""A person in a real browser: ``dg dev`` on the demo's instance (one for the module), headless
Debian Chromium driven by Playwright.  Materialise a ``ct_windows`` partition from the UI and
see its preview (three oriented views per window, at least 256 px each); each scan's check
result on its own; ``ct_hu``'s spacing, shape and HU percentiles; the demo's runs
re-executable as the UI's own.  Screenshots are saved for a person to look at (CI keeps
``screenshots/``)."""

import os
import re
from pathlib import Path

import pytest
from dagsterdev import start_dagster_dev

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1200)]
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(os.environ.get("ZARRFEED_SCREENSHOTS", Path(__file__).parents[1] / "screenshots"))
KEY = "train_1_a_1"
VIEW_PX = 256  # a preview's view, at least, on its longer side


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
def ui(demo, browser):
    """(base URL, page): one ``dg dev`` on the demo's instance for every test here."""
    tmp, env, _ = demo
    SHOTS.mkdir(parents=True, exist_ok=True)
    with start_dagster_dev(env, tmp / "dagster_dev_browser.log") as port:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(60_000)
        dismiss = page.get_by_role("button", name="Skip")  # the first-visit newsletter dialog
        page.add_locator_handler(page.get_by_text("Join the Dagster community"), dismiss.click)
        yield f"http://127.0.0.1:{port}", page
        page.close()


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


def test_a_check_reports_each_scan_on_its_own(ui):
    url, page = ui
    page.goto(f"{url}/assets/ct_windows?view=checks", wait_until="networkidle")
    page.get_by_text("Partitions", exact=True).last.click()  # the check's own partitions
    passed = page.get_by_text(re.compile(r"^Passed \(\d+\)$")).first
    passed.wait_for()
    assert int(re.search(r"\d+", passed.inner_text()).group()) >= 7  # the demo's good scans
    page.get_by_text(KEY, exact=True).first.click()  # one scan: its own result and metadata
    page.get_by_text("out_of_range", exact=True).first.wait_for()
    page.screenshot(path=SHOTS / "5_check_per_partition.png")
    detail = page.locator("body").inner_text()
    assert re.search(rf"{KEY}\s+Passed\s+Latest execution", detail), detail[-2000:]
    assert re.search(r"out_of_range\s+none", detail) and "{}" not in detail  # no empty JSON


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


@pytest.mark.parametrize("job", ["ct_build", "train"])
def test_a_demo_run_re_executes_as_the_uis_own(ui, demo, job):
    """No warning that the run was loaded from a different code location (or another
    version of its job): the demo's build runs and its training runs (an asset subset)."""
    from test_demo import instance_at

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
