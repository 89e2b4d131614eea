"""A person in a real browser: ``dg dev`` on the demo's instance, headless Debian Chromium
driven by Playwright.  Find ``ct_windows`` in the catalog, materialise one partition from the
UI, wait for the run to succeed, and see its preview: three orthogonal slices per window,
labelled.  Screenshots are saved for a person to look at (CI keeps ``screenshots/``)."""

import os
from pathlib import Path

import pytest
from dagsterdev import start_dagster_dev

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1200)]
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(os.environ.get("ZARRFEED_SCREENSHOTS", Path(__file__).parents[1] / "screenshots"))
KEY = "train_1_a_1"


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


def test_materialise_a_ct_windows_partition_from_the_ui_and_see_its_preview(demo, browser):
    tmp, env, _ = demo
    SHOTS.mkdir(parents=True, exist_ok=True)
    with start_dagster_dev(env, tmp / "dagster_dev_browser.log") as port:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(60_000)
        dismiss = page.get_by_role("button", name="Skip")  # the first-visit newsletter dialog
        page.add_locator_handler(page.get_by_text("Join the Dagster community"), dismiss.click)

        page.goto(f"http://127.0.0.1:{port}/assets", wait_until="networkidle")
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

        page.goto(f"http://127.0.0.1:{port}/assets/ct_windows", wait_until="networkidle")
        latest = page.get_by_text("Latest materialization").locator("..")
        latest.get_by_text(KEY).wait_for()
        row = page.locator("tr", has=page.get_by_text("preview", exact=True))
        row.get_by_text("[Show Markdown]").click()
        image = page.locator(".dagster-dialog img").first
        image.wait_for()
        page.wait_for_function(
            "img => img.complete && img.naturalWidth > 0", arg=image.element_handle()
        )
        page.screenshot(path=SHOTS / "4_preview.png")
        width, height = image.evaluate("img => [img.naturalWidth, img.naturalHeight]")
        alt = image.get_attribute("alt")
        dialog_text = page.locator(".dagster-dialog").inner_text()
    assert width > 3 * 128 and height > 3 * 128, (width, height)  # 3 windows × 3 views
    assert all(w in alt for w in ("lung", "mediastinum", "bone")) and KEY in alt, alt
    assert KEY in dialog_text
