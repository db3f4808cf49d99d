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


# -- finding 11: a replayed report says it is late --------------------------------

def test_a_replayed_report_is_flagged_late(tmp_path):
    port = free_port()
    before = time.time()
    rid, data = body(1)
    assert deliverer(port, tmp_path).deliver("epilog", rid, data) == "spooled"
    (path,) = tmp_path.glob("*.json")
    assert path.name.endswith(f"-epilog-{rid}.t1.json")
    late = Agent.__new__(Agent)
    Agent.__init__(late)
    try:
        rid2, data2 = body(2, "health")
        assert deliverer(late.port, tmp_path).deliver("health", rid2, data2) == "sent"
    finally:
        late.stop()
    replayed, fresh = late.received
    assert replayed["n"] == 1 and "delivery" not in fresh
    delivery = replayed["delivery"]
    assert delivery["tries"] == 2 and delivery["by"] == "health"
    assert before - 1 <= delivery["spooled_at"] <= time.time()


def test_failed_replays_are_counted_in_the_file_name(tmp_path):
    from slurm_hooks.delivery import spool_facts
    port = free_port()
    d = deliverer(port, tmp_path)
    rid, data = body(1)
    assert d.deliver("epilog", rid, data) == "spooled"
    for _ in range(2):
        assert d.replay(by="replayer") == (0, False)
    (path,) = d.pending()
    spooled_at, tries = spool_facts(path.name)
    assert tries == 3 and abs(spooled_at - time.time()) < 60
    late = Agent.__new__(Agent)
    Agent.__init__(late)
    try:
        assert deliverer(late.port, tmp_path).replay(by="replayer") == (1, True)
    finally:
        late.stop()
    assert late.received[0]["delivery"]["tries"] == 4
    assert late.received[0]["delivery"]["by"] == "replayer"


def test_a_spool_file_from_an_older_hook_still_replays(agent, tmp_path):
    rid, data = body(1)
    (tmp_path / f"{1_800_000_000 * 10**9:020d}-epilog-{rid}.json").write_bytes(data)
    assert deliverer(agent.port, tmp_path).replay() == (1, True)
    assert agent.received[0]["delivery"] == {"spooled_at": 1_800_000_000.0, "tries": 2,
                                             "by": "hook"}


def test_pauses_retry_the_post_before_spooling(tmp_path):
    """An agent that fails the first POST (503) takes the retry: nothing spooled."""
    flaky = Agent()
    flaky.status = 503
    threading.Timer(0.2, lambda: setattr(flaky, "status", 201)).start()
    try:
        rid, data = body(1)
        started = time.monotonic()
        assert deliverer(flaky.port, tmp_path).deliver("epilog", rid, data,
                                                       pauses=(0.5,)) == "sent"
        assert time.monotonic() - started < 2
    finally:
        flaky.stop()
    assert [r["n"] for r in flaky.received] == [1] and "delivery" not in flaky.received[0]
    assert list(tmp_path.glob("*.json")) == []


def test_pauses_are_bounded_and_every_try_is_counted(tmp_path):
    rid, data = body(1)
    started = time.monotonic()
    d = deliverer(free_port(), tmp_path)
    assert d.deliver("epilog", rid, data, pauses=(0.2, 0.3)) == "spooled"
    assert 0.5 <= time.monotonic() - started < 2
    (path,) = d.pending()
    assert path.name.endswith(".t3.json")


def test_epilog_reports_replay_before_a_backlog_of_health_reports(agent, tmp_path):
    d = deliverer(free_port(), tmp_path)
    for n in range(60):
        assert d.deliver("health", *body(n, "health")) == "spooled"
    assert d.deliver("epilog", *body(99, "epilog")) == "spooled"
    assert deliverer(agent.port, tmp_path).replay() == (50, True)   # one run's budget
    assert agent.received[0]["n"] == 99
    assert [r["n"] for r in agent.received[1:4]] == [0, 1, 2]


# -- the spool is sent with root's credential: only root may fill it ---------------

def _forged(n: int) -> tuple[str, str]:
    rid = f"{n:032x}"
    return (f"{time.time_ns():020d}-epilog-{rid}.t1.json",
            json.dumps({"hook": "epilog", "report_id": rid, "n": n, "node": "node4",
                        "xids": [{"xid": 79, "raw": "NVRM: Xid (PCI:0000:28:00): 79"}]}))


@pytest.mark.security
def test_a_users_spool_is_never_replayed_with_roots_credential(agent, unix_users):
    import shutil
    import tempfile
    from pathlib import Path
    mallory = unix_users("mallory")
    base = Path(tempfile.mkdtemp(prefix="spool-sec-", dir="/tmp"))
    try:
        base.chmod(0o755)
        spool = base / "spool"
        base.chmod(0o777)   # a shared directory where mallory got there first
        mallory.run(["mkdir", "-m", "777", str(spool)])
        name, forged = _forged(66)
        mallory.run(["sh", "-c", 'printf "%s" "$1" > "$2"', "sh", forged, str(spool / name)])
        victim = base / "victim"          # a root file the planted lock link points at
        victim.write_text("keep\n")
        mallory.run(["ln", "-s", str(victim), str(spool / ".replay.lock")])
        base.chmod(0o755)
        d = deliverer(agent.port, spool)
        rid, data = body(1, "health")
        assert d.deliver("health", rid, data) == "sent"    # its own report still goes
        assert [r["n"] for r in agent.received] == [1]      # the planted one never
        assert d.deliver("epilog", *body(2)) == "sent"
        assert list(spool.glob("*.json")) == [spool / name]  # nor is root's spooled there
        assert victim.read_text() == "keep\n"                  # the link was not opened
        # the admin takes the directory back; mallory's file is still hers
        shutil.chown(spool, "root", "root")
        spool.chmod(0o755)
        assert d.replay() == (0, True)      # the planted lock link is not opened either
        (spool / ".replay.lock").unlink()
        assert d.replay() == (1, True)                      # out of the spool, unsent
        assert [r["n"] for r in agent.received] == [1, 2]
        assert victim.read_text() == "keep\n"
        assert [p.name for p in (spool / "untrusted").iterdir()] == [name]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_link_in_the_spool_is_not_followed(agent, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"hook": "epilog", "report_id": "f" * 32, "n": 7}))
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    link = spool / _forged(7)[0]
    link.symlink_to(secret)
    assert deliverer(agent.port, spool).replay() == (1, True)   # it left the spool
    assert agent.received == []
    assert (spool / "corrupt" / link.name).is_symlink()
