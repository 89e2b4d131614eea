"""``dg dev`` on 127.0.0.1 for end-to-end tests: started in its own process group on a free
port with the given environment, torn down with the group.

It runs in the log's folder, not the repository: the dagster CLI lets the ``.env`` of its
working folder override the environment, and the tests' folders are not the defaults."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from services import default_signals

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@contextlib.contextmanager
def start_dagster_dev(env: dict[str, str], log_path: Path, timeout: float = 120) -> Iterator[int]:
    """Webserver + daemon (sensors, automation) for ``workspace.yaml``; yields the port once
    the webserver answers.  A ``dg dev`` that exits first, or is not up within ``timeout``
    seconds, fails naming its log."""
    port = free_port()
    cmd = [Path(sys.executable).with_name("dg"), "dev", "-w", REPO / "workspace.yaml",
           "-h", "127.0.0.1", "-p", str(port)]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=log_path.parent,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=default_signals,
        )
        try:

            def up() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"dg dev exited {proc.returncode}; see {log_path}")
                try:
                    url = f"http://127.0.0.1:{port}/server_info"
                    return urllib.request.urlopen(url).status == 200
                except OSError:
                    return False

            wait_for(up, timeout, f"the webserver (log: {log_path})")
            yield port
        finally:
            with contextlib.suppress(ProcessLookupError):  # the group has already gone
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
