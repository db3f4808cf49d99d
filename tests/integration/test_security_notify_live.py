"""A user-given notify= URL reaches only hosts an admin allowed (issue 14,
finding 4), live: a real unprivileged user's jobs fail for good (stop), one
naming a loopback service its environment does not allow, one naming an allowed
host that answers with a redirect to another service. The first is refused and
never contacted; the second is posted to once and its redirect not followed."""
from __future__ import annotations

import http.server
import socket
import threading

import pytest

from tests.integration.conftest import AgentProcess, job_row, wait_for

pytestmark = [pytest.mark.live, pytest.mark.security]


class Listener:
    """A loopback HTTP service that records every request it gets."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):   # noqa: N802 - http.server's name
                seen.append(("POST", self.path))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}"
                                             "/internal-admin")
                self.end_headers()

            def do_GET(self):    # noqa: N802
                seen.append(("GET", self.path))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    server = Listener()
    yield server
    server.close()


@pytest.fixture
def notify_agent(devcluster, tmp_path, listener):
    config = tmp_path / "recovery.toml"
    config.write_text(devcluster.lay.agent_config.read_text()
                      + '[environments.guarded]\nmode = "action"\n'
                      + f'[environments.opened]\nmode = "action"\n'
                        f'notify_allow = "127.0.0.1:{listener.port}"\n')
    agent = AgentProcess(devcluster, db=tmp_path / "recovery.db")
    agent.config = config
    agent.start()
    yield agent
    agent.stop()


def stopped_with_notify(agent, job_id: str):
    row = job_row(agent, job_id)
    if row is None:
        return None
    rows = agent.query("select r.id, r.action, r.status, s.state, s.detail from "
                       "recommendations r join rec_steps s on s.rec = r.id where r.job = ? "
                       "and s.step = 'notify'", row[0])
    return rows or None


@pytest.mark.parametrize("env", ["guarded", "opened"])
def test_user_notify_url_reaches_only_allowed_hosts(notify_agent, submit, unix_users,
                                                    listener, env):
    mallory = unix_users("mallory")
    url = f"http://127.0.0.1:{listener.port}/{env}"
    script = "/usr/bin/python3 -c \"print('step 1'); d = {}; d['missing']\""
    job_id = submit("-N1", f"--recovery={env},notify={url}", "-o", "notify-%j.out",
                    script=script, as_user=mallory)
    rows = wait_for(lambda: stopped_with_notify(notify_agent, job_id), 90,
                    f"job {job_id} stopped with a notify step")
    (_, action, status, state, detail) = rows[0]
    assert (action, status) == ("stop", "done")
    if env == "guarded":
        assert state == "refused" and "notify_allow" in detail
        assert listener.seen == []
    else:
        assert state == "failed" and "302" in detail    # posted; the redirect not taken
        assert listener.seen == [("POST", "/opened")]
