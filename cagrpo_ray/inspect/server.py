"""The live inspector: a run's inspected steps served read-only over HTTP while it trains.

    server = InspectorServer(run_dir, host="127.0.0.1", port=0).start()
    server.url          # http://127.0.0.1:<port>/
    server.close()

GET only:  /             the newest inspected step's page
           /step/<N>     step N's page
           /steps.json   the inspected steps, a JSON list of ints, ascending

Prompts and responses can be sensitive, so the default host is loopback; while bound to
loopback, a request whose Host header names another host is refused (403), so that a web page
cannot read the inspector through a DNS name rebound to 127.0.0.1. Pages are rendered on
request from the Parquet files and the last few are kept, keyed by the file's modification
time and the list of steps (whose links the page shows).
"""

from __future__ import annotations

import html
import json
import os
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from cagrpo_ray.console import log_dir
from cagrpo_ray.inspect.page import render_page
from cagrpo_ray.inspect.records import inspected_steps, read_step, step_path
from cagrpo_ray.rewards.errors import ERRORS_FILE, read_errors

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
CACHED_PAGES = 4
STEP_PATH = re.compile(r"/step/(\d+)/?")


class InspectorServer:
    """Serves RUN_DIR/inspect/step_*.parquet as inspector pages from a daemon thread.

    The socket is bound on construction (port 0 picks a free port; `url` and `port` say
    which); `start` serves from a daemon thread, `serve_forever` from the calling one."""

    def __init__(self, run_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 0):
        self.run_dir = Path(run_dir)
        self.host = host
        self._pages: dict[tuple, bytes] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._httpd = ThreadingHTTPServer((host, port), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.inspector = self

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> InspectorServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="inspector-http", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> InspectorServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def page(self, step: int | None) -> bytes:
        """The page of `step` (None: the newest). Raises FileNotFoundError like `read_step`."""
        steps = inspected_steps(self.run_dir)
        step = steps[-1] if step is None and steps else step
        stamp = step_path(self.run_dir, step).stat().st_mtime_ns if step in steps else None
        key = (step, stamp, tuple(steps))
        with self._lock:
            if key in self._pages:
                return self._pages[key]
        table, metadata = read_step(self.run_dir, step)
        errors = read_errors(log_dir(self.run_dir) / ERRORS_FILE)
        page = render_page(table, metadata, steps, reward_errors=errors).encode()
        with self._lock:
            self._pages[key] = page
            while len(self._pages) > CACHED_PAGES:
                self._pages.pop(next(iter(self._pages)))
        return page


class _Handler(BaseHTTPRequestHandler):
    server_version = "cagrpo-inspector"

    def do_GET(self) -> None:
        inspector: InspectorServer = self.server.inspector
        if inspector.host in LOOPBACK_HOSTS and _host_name(self.headers) not in LOOPBACK_HOSTS:
            return self._send(HTTPStatus.FORBIDDEN, "text/plain", b"loopback only\n")
        path = urlsplit(self.path).path
        if path == "/steps.json":
            body = json.dumps(inspected_steps(inspector.run_dir)).encode()
            return self._send(HTTPStatus.OK, "application/json", body)
        match = STEP_PATH.fullmatch(path)
        if path != "/" and match is None:
            return self._send(HTTPStatus.NOT_FOUND, "text/plain", f"no page {path}\n".encode())
        try:
            page = inspector.page(int(match.group(1)) if match else None)
        except FileNotFoundError as error:
            # Live runs start serving before the first inspected step: the page reloads itself.
            body = (
                "<!DOCTYPE html><meta charset=utf-8><meta http-equiv=refresh content=15>"
                f"<title>token inspector</title><p>{html.escape(str(error))}</p>"
            )
            return self._send(HTTPStatus.NOT_FOUND, "text/html", body.encode())
        self._send(HTTPStatus.OK, "text/html", page)

    def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", f"{kind}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:
        """Quiet: a request line per token-page view would drown the driver's log."""


def _host_name(headers) -> str:
    """The host named by the Host header, without port or IPv6 brackets."""
    host = (headers.get("Host") or "").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if ":" in host else host
