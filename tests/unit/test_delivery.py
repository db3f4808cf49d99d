"""Hook delivery: a real HTTP exchange with a stand-in agent, the spool, and replay."""
from __future__ import annotations

import errno
import http.server
import json
import logging
import socket
import threading
import time

import pytest

from slurm_hooks.delivery import Deliverer
from tests.conftest import small_tmpfs


class Agent:
    """A tiny HTTP server answering like the agent would, as told."""

    def __init__(self) -> None:
        self.status = 201
        self.delay = 0.0
        self.received: list[dict] = []
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(agent.delay)
                if agent.status in (200, 201):
                    agent.received.append({"path": self.path, **json.loads(body)})
                self.send_response(agent.status)
                self.end_headers()
                self.wfile.write(b'{"status": "x"}')

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def agent():
    a = Agent()
    yield a
    a.stop()


def body(n: int, hook: str = "epilog") -> tuple[str, bytes]:
    rid = f"{n:032x}"
    return rid, json.dumps({"hook": hook, "report_id": rid, "n": n}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deliverer(port: int, spool, timeout: float = 0.5) -> Deliverer:
    return Deliverer(f"http://127.0.0.1:{port}", timeout, spool, sign=False)


def test_sent_when_the_agent_is_up(agent, tmp_path):
    rid, data = body(1)
    assert deliverer(agent.port, tmp_path).deliver("epilog", rid, data) == "sent"
    assert agent.received[0]["path"] == "/v1/hooks/epilog"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.resilience("agent down: node reports spooled and replayed",
                        "reports spool while the agent is down and replay oldest first")
def test_agent_down_spools_then_replays_oldest_first(tmp_path):
    port = free_port()
    d = deliverer(port, tmp_path)
    started = time.monotonic()
    for n in (1, 2, 3):
        rid, data = body(n)
        assert d.deliver("epilog", rid, data) == "spooled"
    assert time.monotonic() - started < 2  # a refused connection costs milliseconds
    assert len(d.pending()) == 3
    late = Agent.__new__(Agent)
    Agent.__init__(late)
    try:
        rid, data = body(4, "prolog")
        assert deliverer(late.port, tmp_path).deliver("prolog", rid, data) == "sent"
        assert [r["n"] for r in late.received] == [1, 2, 3, 4]
        assert [r["path"] for r in late.received][-1] == "/v1/hooks/prolog"
    finally:
        late.stop()
    assert deliverer(port, tmp_path).pending() == []


@pytest.mark.resilience("network partition between a node and the agent",
                        "a silent agent costs the hook its timeout, not more")
def test_slow_agent_hits_the_timeout(agent, tmp_path):
    agent.delay = 2.0
    rid, data = body(1)
    started = time.monotonic()
    assert deliverer(agent.port, tmp_path, timeout=0.3).deliver("epilog", rid, data) == "spooled"
    assert time.monotonic() - started < 1.5


def test_duplicate_counts_as_delivered(agent, tmp_path):
    agent.status = 200
    rid, data = body(1)
    assert deliverer(agent.port, tmp_path).deliver("epilog", rid, data) == "duplicate"
    assert deliverer(agent.port, tmp_path).pending() == []


def test_rejected_report_is_kept_aside(agent, tmp_path):
    agent.status = 400
    rid, data = body(1)
    assert deliverer(agent.port, tmp_path).deliver("epilog", rid, data) == "rejected"
    kept = list((tmp_path / "rejected").iterdir())
    assert len(kept) == 1 and kept[0].read_bytes() == data


def test_server_error_spools(agent, tmp_path):
    agent.status = 503
    rid, data = body(1)
    assert deliverer(agent.port, tmp_path).deliver("epilog", rid, data) == "spooled"


def test_corrupt_spool_file_is_moved_aside(agent, tmp_path, caplog):
    (tmp_path / "00000000000000000001-epilog-x.json").write_bytes(b"\x00\x01garbage")
    d = deliverer(agent.port, tmp_path)
    d.spool("epilog", *body(2))
    rid, data = body(3)
    with caplog.at_level(logging.ERROR, logger="slurm_hooks"):
        assert d.deliver("epilog", rid, data) == "sent"
    assert [r["n"] for r in agent.received] == [2, 3]
    assert [p.name for p in (tmp_path / "corrupt").iterdir()] == \
        ["00000000000000000001-epilog-x.json"]
    assert any("moved to corrupt/" in r.getMessage() for r in caplog.records)


@pytest.mark.resilience("spool directory full on a node",
                        "the delivery logs the lost report and does not raise")
def test_full_spool_disk_logs_and_does_not_raise(tmp_path, caplog, monkeypatch):
    """A real full filesystem where we may mount one; else open() says ENOSPC."""
    mnt = tmp_path / "small"
    with small_tmpfs(mnt, "64k") as mounted:
        if mounted:
            try:
                (mnt / "filler").write_bytes(b"x" * 64 * 1024)  # may stop short: full
            except OSError:
                pass
        else:
            import builtins
            real_open = builtins.open

            def full_open(path, mode="r", *a, **kw):
                if "w" in mode and str(path).startswith(str(mnt)):
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_open(path, mode, *a, **kw)
            monkeypatch.setattr(builtins, "open", full_open)
        rid, data = body(1)
        big = data + b" " * 128 * 1024  # larger than any room left
        with caplog.at_level(logging.ERROR, logger="slurm_hooks"):
            outcome = deliverer(free_port(), mnt / "spool").deliver("epilog", rid, big)
        assert outcome == "lost"
        assert any("cannot spool" in r.getMessage() for r in caplog.records)
