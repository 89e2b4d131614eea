"""A small Hugging Face hub on 127.0.0.1 serving one dataset repository from a folder.

Implements what ``huggingface_hub`` calls for CT-RATE: revision info, the paginated tree API
(``Link: <…>; rel="next"``), and ``resolve`` with HEAD/GET, LFS headers and Range requests.
It can require a token (401 otherwise), and cut the first transfer of chosen files midway.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

SHA = "0123456789abcdef0123456789abcdef01234567"


class MockHub:
    def __init__(self, root: Path, repo: str, token: str | None = None, page: int = 3) -> None:
        self.root, self.repo, self.token, self.page = Path(root), repo, token, page
        self.requests: list[dict] = []
        self.cut: set[str] = set()  # paths whose next GET stops halfway
        self._sha256: dict[str, str] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> MockHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def sha256(self, path: str) -> str:
        if path not in self._sha256:
            self._sha256[path] = hashlib.sha256((self.root / path).read_bytes()).hexdigest()
        return self._sha256[path]

    def gets(self, path: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == "GET" and r["path"].endswith("/" + path)]

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, data, headers: dict | None = None) -> None:
                self._send(
                    200,
                    json.dumps(data).encode(),
                    {"Content-Type": "application/json", **(headers or {})},
                )

            def _authorised(self) -> bool:
                if hub.token is None or self.headers.get("Authorization") == f"Bearer {hub.token}":
                    return True
                self._send(
                    401,
                    b'{"error": "Access to this dataset is restricted"}',
                    {"X-Error-Code": "GatedRepo", "X-Error-Message": "gated"},
                )
                return False

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                url = urlparse(self.path)
                path = unquote(url.path)
                hub.requests.append(
                    {
                        "method": self.command,
                        "path": path,
                        "range": self.headers.get("Range"),
                        "authorization": self.headers.get("Authorization"),
                    }
                )
                if not self._authorised():
                    return
                api = f"/api/datasets/{hub.repo}/"
                if path.startswith(api + "revision/"):
                    return self._json(
                        {
                            "id": hub.repo,
                            "_id": "1",
                            "sha": SHA,
                            "private": False,
                            "gated": "manual",
                            "disabled": False,
                            "downloads": 0,
                            "likes": 0,
                            "tags": [],
                            "siblings": [],
                        }
                    )
                if path.startswith(api + "tree/"):
                    return self._tree(path[len(api + "tree/") :], parse_qs(url.query))
                prefix = f"/datasets/{hub.repo}/resolve/"
                if path.startswith(prefix):
                    return self._resolve(path[len(prefix) :].split("/", 1)[1])
                self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"})

            def _tree(self, rest: str, query: dict) -> None:
                folder = rest.split("/", 1)[1] if "/" in rest else ""
                base = hub.root / folder
                if not base.is_dir():
                    return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"})
                paths = (
                    sorted(base.rglob("*"))
                    if query.get("recursive") == ["true"]
                    else sorted(base.iterdir())
                )
                entries = []
                for p in paths:
                    rel = str(p.relative_to(hub.root))
                    if p.is_dir():
                        entries.append({"type": "directory", "oid": "d" * 40, "path": rel})
                    else:
                        size = p.stat().st_size
                        entries.append(
                            {
                                "type": "file",
                                "oid": "f" * 40,
                                "size": size,
                                "path": rel,
                                "lfs": {"oid": hub.sha256(rel), "size": size, "pointerSize": 134},
                            }
                        )
                start = int(query.get("cursor", ["0"])[0])
                page = entries[start : start + hub.page]
                headers = {}
                if start + hub.page < len(entries):
                    recursive = query.get("recursive", ["false"])[0]
                    nxt = f"{hub.url}{self.path.split('?')[0]}?recursive={recursive}"
                    nxt += f"&cursor={start + hub.page}"
                    headers["Link"] = f'<{nxt}>; rel="next"'
                self._json(page, headers)

            def _resolve(self, rel: str) -> None:
                file = hub.root / rel
                if not file.is_file():
                    return self._send(
                        404,
                        b"{}",
                        {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"},
                    )
                data = file.read_bytes()
                etag = hub.sha256(rel)
                headers = {
                    "X-Repo-Commit": SHA,
                    "ETag": f'"{etag}"',
                    "X-Linked-Etag": f'"{etag}"',
                    "X-Linked-Size": str(len(data)),
                    "Accept-Ranges": "bytes",
                }
                if self.command == "HEAD":
                    self.send_response(200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return
                start = 0
                if rng := self.headers.get("Range"):
                    start = int(rng.split("=")[1].split("-")[0])
                body = data[start:]
                self.send_response(206 if start else 200)
                for k, v in headers.items():
                    self.send_header(k, v)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if rel in hub.cut:  # drop the connection halfway through the body
                    hub.cut.discard(rel)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        return Handler
