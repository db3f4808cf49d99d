"""A small slurmrestd stand-in for the REST backend's unit tests: a real HTTP
server in a thread (TCP or a unix socket) that answers from a route table and
records every request. The answers are recorded slurmrestd output
(tests/fixtures/slurm/22.05/rest/) or, for 24.11 and 26.05, the recorded CLI
JSON of those releases, which comes from the same data_parser as their REST
answers (tests/fixtures/slurm/README.md)."""
from __future__ import annotations

import json
import socketserver
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"

# What each release's OpenAPI document offers, by the source (slurmrestd's
# openapi plugins of slurm-22.05.8, 24.11.7 and 26.05.3): (tail, methods).
ENDPOINTS_38 = [("ping/", "get"), ("jobs/", "get"), ("job/{job_id}", "get post delete"),
                ("nodes/", "get"), ("node/{node_name}", "get")]
ENDPOINTS_40 = [("ping/", "get"), ("jobs/", "get delete"),
                ("job/{job_id}", "get post delete"), ("nodes/", "get post"),
                ("node/{node_name}", "get post delete")]
ENDPOINTS_45 = ENDPOINTS_40 + [("job/{job_id}/requeue", "get"), ("jobs/requeue", "post")]


def openapi_doc(versions: dict[str, list]) -> dict:
    paths = {}
    for version, endpoints in versions.items():
        for tail, methods in endpoints:
            paths[f"/slurm/{version}/{tail}"] = {m: {"operationId": f"{m}_{tail}"}
                                                for m in methods.split()}
    return {"openapi": "3.0.2", "info": {"version": "test"}, "paths": paths}


@dataclass
class Answer:
    status: int = 200
    body: bytes | str | dict = b""
    ctype: str = "application/json"
    truncate: int = 0          # announce this many more bytes than are sent


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict
    body: dict | None


@dataclass
class FakeRest:
    routes: dict[tuple[str, str], Answer | Callable[[Seen], Answer]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)

    def answer(self, method: str, path: str, answer) -> None:
        self.routes[(method, path)] = answer

    def requests(self, method: str | None = None) -> list[Seen]:
        return [s for s in self.seen if method is None or s.method == method]


def make_handler(fake: FakeRest):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:   # quiet
            pass

        def _serve(self) -> None:
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            seen = Seen(self.command, parts.path, parts.query, dict(self.headers),
                        json.loads(raw) if raw else None)
            fake.seen.append(seen)
            route = fake.routes.get((self.command, parts.path))
            answer = route(seen) if callable(route) else route
            if answer is None:
                answer = Answer(404, "Unable to find requested URL", "text/plain")
            body = answer.body
            if isinstance(body, dict):
                body = json.dumps(body, indent=2)
            if isinstance(body, str):
                body = body.encode()
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.ctype)
            self.send_header("Content-Length", str(len(body) + answer.truncate))
            if answer.truncate:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            if answer.truncate:
                self.close_connection = True

        do_GET = do_POST = do_DELETE = _serve

    return Handler


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):
        request, _ = super().get_request()
        return request, ("local", 0)


def serve(fake: FakeRest, socket_path: str | None = None):
    """Start the server; returns (url, stop)."""
    handler = make_handler(fake)
    if socket_path:
        server = _UnixServer(socket_path, handler)
        url = f"unix:{socket_path}"
    else:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
    return url, stop


def recorded(version: str, name: str) -> dict:
    return json.loads((FIX / version / name).read_text())


def as_rest(doc: dict, data_parser: str) -> dict:
    """A recorded CLI document of 23.11+ as slurmrestd sends it: the same
    data_parser output, with the openapi plugin named in meta."""
    out = json.loads(json.dumps(doc))
    out.setdefault("meta", {}).setdefault("plugin", {}).update(
        type="openapi/slurmctld", data_parser=f"data_parser/{data_parser}")
    return out
