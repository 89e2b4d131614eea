"""Make the README's pictures: the asset graph and a partitions view from ``dg dev`` on a demo
instance, and a training loss curve as SVG from that demo's training report.

    .venv/bin/python docs/images/make.py               # builds a demo in a temporary folder
    .venv/bin/python docs/images/make.py --demo DIR    # DIR: where `zarrfeed demo` already ran

The browser is Debian's headless Chromium (``apt-get install chromium``) driven by Playwright;
Playwright's own browser download is never used.  The screenshots are PNGs kept small (a
256-colour palette) so the repository stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from dagsterdev import start_dagster_dev  # the `dg dev` the end-to-end tests start

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent
CHROMIUM = Path("/usr/bin/chromium")
VIEWPORT = {"width": 1280, "height": 720}
MAX_PNG_BYTES = 200_000


def demo_env(demo: Path) -> dict[str, str]:
    """The environment ``zarrfeed demo`` prints for opening the UI on its instance."""
    return {
        **os.environ,
        "DAGSTER_HOME": str(demo / ".dagster_home"),
        "ZARRFEED_STORE": str(demo / "data" / "zarrfeed.zarr"),
        "ZARRFEED_RAW": str(demo / "data" / "raw"),
        "ZARRFEED_MODELS": str(demo / "data" / "models"),
    }


def run_demo(demo: Path) -> None:
    env = demo_env(demo)
    cmd = [str(BIN / "zarrfeed"), "demo", "--raw", env["ZARRFEED_RAW"],
           "--store", env["ZARRFEED_STORE"], "--dagster-home", env["DAGSTER_HOME"]]  # fmt: skip
    subprocess.run(cmd, cwd=demo, env=env, check=True)


@contextlib.contextmanager
def dagster_dev(demo: Path) -> Iterator[str]:
    """``dg dev`` on 127.0.0.1 over the demo's instance, as the end-to-end tests start it
    (in the instance folder, whose ``.env`` the dagster CLI would load); yields its URL."""
    log = demo / ".dagster_home" / "docs-images-dev.log"
    with start_dagster_dev(demo_env(demo), log, timeout=180) as port:
        yield f"http://127.0.0.1:{port}"


def save_png(page, path: Path) -> None:
    """A screenshot quantised to 256 colours: UI pictures are flat colours and text."""
    from io import BytesIO

    from PIL import Image

    shot = Image.open(BytesIO(page.screenshot())).convert("RGB")
    shot.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    size = path.stat().st_size
    if size > MAX_PNG_BYTES:
        raise SystemExit(f"{path}: {size} bytes, expected at most {MAX_PNG_BYTES}")
    print(f"wrote {path} ({size // 1000} kB)")


def screenshots(url: str) -> None:
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        raise SystemExit(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(90_000)
        skip = page.get_by_role("button", name="Skip")  # the first-visit newsletter dialog
        page.add_locator_handler(page.get_by_text("Join the Dagster community"), skip.click)
        page.goto(f"{url}/locations/zarrfeed/asset-groups/ct", wait_until="networkidle")
        page.get_by_text("ct_windows", exact=True).first.wait_for()
        page.wait_for_timeout(3000)  # the graph lays out and fits the viewport
        save_png(page, HERE / "asset-graph.png")
        page.goto(f"{url}/assets/ct_windows?view=partitions", wait_until="networkidle")
        page.get_by_text("train_1_a_1", exact=True).first.click()  # one scan's materialisation
        page.get_by_text("arrays", exact=True).first.wait_for()  # its metadata table
        page.wait_for_timeout(2000)
        save_png(page, HERE / "partitions.png")
        browser.close()


def loss_svg(metrics: Path, out: Path, width: int = 640, height: int = 300) -> None:
    """The loss of every step of one training report (``metrics.json``), as a line chart."""
    report = json.loads(metrics.read_text())
    losses = report.get("history", {}).get("loss", [])
    if len(losses) < 2:
        raise SystemExit(f"{metrics}: expected history.loss with 2 or more steps, found {losses}")
    points = list(enumerate(losses, start=1))
    left, right, top, bottom = 60, 20, 30, 40
    steps, losses = [s for s, _ in points], [v for _, v in points]
    lo, hi = min(losses), max(losses)
    span = (hi - lo) or 1.0

    def xy(step: float, loss: float) -> tuple[float, float]:
        x = left + (step - steps[0]) / ((steps[-1] - steps[0]) or 1) * (width - left - right)
        return x, top + (hi - loss) / span * (height - top - bottom)

    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in points))
    ticks = []
    for i in range(5):
        value = lo + span * i / 4
        _, y = xy(steps[0], value)
        ticks.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value:.3g}</text>'
                     f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="#ddd"/>')  # fmt: skip
    task = report.get("task", metrics.parent.name)
    svg = f"""<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" \
font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{left}" y="18" font-size="14">{task}: training loss per step</text>
{"".join(ticks)}
<polyline fill="none" stroke="#4f43dd" stroke-width="2" points="{line}"/>
<text x="{left}" y="{height - 12}">step {steps[0]}</text>
<text x="{width - right}" y="{height - 12}" text-anchor="end">step {steps[-1]}</text>
</svg>
"""
    out.write_text(svg)
    print(f"wrote {out} ({len(svg) // 1000} kB, {len(points)} points from {metrics})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, help="a folder where `zarrfeed demo` ran")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        demo = args.demo
        if demo is None:
            demo = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zarrfeed-docs-")))
            run_demo(demo)
        demo = demo.resolve()
        reports = sorted((demo / "data" / "models").glob("ct_classifier/**/metrics.json"))
        if not reports:
            raise SystemExit(f"{demo}: no ct_classifier metrics.json under data/models")
        loss_svg(reports[-1], HERE / "loss.svg")
        with dagster_dev(demo) as url:
            screenshots(url)


if __name__ == "__main__":
    main()
