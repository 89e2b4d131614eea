"""The docs cannot rot: every fenced code block of README.md and docs/*.md runs (or says why it
cannot), every ``zarrfeed`` subcommand they name exists, and every link between them resolves.

A page's python blocks run in order as one script, its bash blocks in order as one
``bash -euo pipefail`` script, both in a fresh folder laid out like a checkout after the demo:
``.venv`` (this interpreter's environment), ``configs/``, ``workspace.yaml`` and
``data/zarrfeed.zarr`` (the session's small built store).  A block fenced ``bash no-run: WHY``
(or ``python no-run: WHY``) is not run: a server that runs until stopped, the network, minutes
of work another test does."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zarrfeed.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
VENV = Path(sys.executable).parent.parent
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
NO_RUN = re.compile(r"^no-run: (\S.{9,})$")  # the reason: ten characters at least
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MAX_README_CHARS = 10_000
MAX_PNG_BYTES = 200_000


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """(language, what follows it on the fence line, code) of each fenced block."""
    out = []
    for info, code in FENCE.findall(page.read_text()):
        lang, _, rest = info.strip().partition(" ")
        out.append((lang, rest.strip(), code))
    return out


def runnable(page: Path, lang: str) -> str:
    return "".join(code for got, rest, code in blocks(page) if got == lang and not rest)


def name(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text) < MAX_README_CHARS, f"README.md: {len(text)} characters, expected fewer"
    first = blocks(README)[0][2].splitlines()
    assert first[0].startswith("./setup.sh && .venv/bin/zarrfeed demo   # set up"), first
    assert first[1].startswith(".venv/bin/python -m pytest   "), first
    linked = {m for m in LINK.findall(text) if m.startswith("docs/") and m.endswith(".md")}
    pages = {name(page) for page in PAGES[1:]}
    assert pages <= linked, f"README.md does not link {sorted(pages - linked)}"
    for image in ("asset-graph.png", "partitions.png", "loss.svg"):
        assert f"(docs/images/{image})" in text, f"README.md: no picture {image}"


def test_every_block_runs_or_says_why_not():
    wrong = []
    for page in PAGES:
        for lang, rest, code in blocks(page):
            if lang not in ("python", "bash"):
                wrong.append(f"{name(page)}: a ```{lang} block no test runs: {code[:60]!r}")
            elif rest and not NO_RUN.match(rest):
                wrong.append(f"{name(page)}: ```{lang} {rest}: expected 'no-run: <why>'")
    assert not wrong, "\n".join(wrong)


@pytest.fixture
def checkout(tmp_path: Path, built) -> Path:
    """A folder laid out as the docs' commands expect: the venv, configs and a built store."""
    store, _ = built
    (tmp_path / ".venv").symlink_to(VENV)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "workspace.yaml").symlink_to(REPO / "workspace.yaml")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "zarrfeed.zarr").symlink_to(Path(store.url))
    return tmp_path


def run_env() -> dict[str, str]:
    """The docs' defaults apply: no store, raw folder or instance named in the environment."""
    named = ("ZARRFEED_STORE", "ZARRFEED_RAW", "ZARRFEED_MODELS", "DAGSTER_HOME")
    env = {k: v for k, v in os.environ.items() if k not in named}
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_page(checkout: Path, page: Path, lang: str) -> None:
    code = runnable(page, lang)
    script = checkout / ("blocks.py" if lang == "python" else "blocks.sh")
    script.write_text(code if lang == "python" else "set -euo pipefail\n" + code)
    cmd = [sys.executable, str(script)] if lang == "python" else ["bash", str(script)]
    done = subprocess.run(cmd, cwd=checkout, env=run_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, (
        f"{name(page)}: its {lang} blocks exited {done.returncode}, expected 0\n"
        f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p, "python")], ids=name)
def test_the_python_blocks_run(checkout, page):
    run_page(checkout, page, "python")


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p, "bash")], ids=name)
def test_the_bash_blocks_run(checkout, page):
    run_page(checkout, page, "bash")


def help_text(*argv: str) -> str:
    """``zarrfeed ARGV --help`` as the parser prints it, in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser([*argv, "--help"]).parse_args([*argv, "--help"])
    return out.getvalue()


def choices(usage: str) -> set[str]:
    """The subcommands a usage line offers: its first ``{a,b}`` that is not an option's value."""
    for found in re.finditer(r"(\S+)?\s+\{([a-z,-]+)\}", usage):
        before = found.group(1) or ""
        if before.lstrip("[").startswith("-") and not before.endswith("]"):
            continue  # --size {small,full}
        return set(found.group(2).split(","))
    return set()


def test_every_zarrfeed_subcommand_named_exists():
    """What the pages call ``zarrfeed X [Y]``, in code, is a command of ``zarrfeed --help``
    (and Y one of X's own subcommands where X has them)."""
    top = subprocess.run([str(VENV / "bin" / "zarrfeed"), "--help"], capture_output=True,
                         text=True, env=run_env(), check=True).stdout  # fmt: skip
    commands = choices(top)
    assert {"demo", "train", "status"} <= commands, top
    code = "\n".join(
        [c for page in PAGES for _, _, c in blocks(page)]
        + [span for page in PAGES for span in re.findall(r"`([^`\n]+)`", page.read_text())]
    )
    named = set(re.findall(r"(?:^|[\s/])zarrfeed ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", code, re.M))
    assert {c for c, _ in named} >= {"demo", "train", "status", "inspect", "cache"}, named
    wrong = [f"zarrfeed {c}" for c, _ in named if c not in commands]
    for command in sorted({c for c, _ in named} & commands):
        subs = choices(help_text(command).split("\n\n")[0])
        wrong += [f"zarrfeed {c} {s}" for c, s in named if c == command and s and subs
                  and s not in subs]  # fmt: skip
    assert not wrong, f"named in the docs, not a command of `zarrfeed --help`: {sorted(wrong)}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_link_between_the_docs_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{name(page)}: {target}: no file {file}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{name(page)}: {target}: no heading #{anchor} in {file.name}")
    assert not broken, "\n".join(broken)


def test_the_pictures_are_small():
    pictures = sorted((DOCS / "images").glob("*.png"))
    assert pictures, f"no PNG in {DOCS / 'images'}"
    big = [f"{p.name}: {p.stat().st_size} bytes" for p in pictures
           if p.stat().st_size >= MAX_PNG_BYTES]  # fmt: skip
    assert not big, f"expected each picture under {MAX_PNG_BYTES} bytes: {big}"
