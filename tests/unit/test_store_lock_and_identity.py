"""One agent per store (the lock), and a job's identity across requeues."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from recovery_agent.errors import StoreError
from recovery_agent.act.notify import notify
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Recommendation, Store, StoreLock


def test_second_lock_on_one_store_is_refused_naming_the_holder(tmp_path):
    first = StoreLock(tmp_path / "r.db")
    first.acquire()
    try:
        with pytest.raises(StoreError, match=f"pid {os.getpid()}"):
            StoreLock(tmp_path / "r.db").acquire()
        assert StoreLock(tmp_path / "r.db").held_elsewhere()
    finally:
        first.release()
    assert not StoreLock(tmp_path / "r.db").held_elsewhere()
    again = StoreLock(tmp_path / "r.db")
    again.acquire()       # free once released
    again.release()


def test_lock_of_a_killed_holder_is_free(tmp_path):
    code = ("import os, signal, sys; from recovery_agent.store import StoreLock; "
            f"StoreLock({str(tmp_path / 'r.db')!r}).acquire(); "
            "print('held', flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -9 and "held" in proc.stdout
    lock = StoreLock(tmp_path / "r.db")
    lock.acquire()
    lock.release()


def job(submit: int, restarts: int, **kw) -> Job:
    return Job(job_id="42", numeric_id=42, submit_time=submit, restart_count=restarts,
               user=kw.pop("user", "ana"), name=kw.pop("name", "train"), **kw)


def test_requeued_job_keeps_its_row_although_slurm_renews_the_submit_time(tmp_path):
    store = Store(tmp_path / "r.db")
    pk = store.record_job(job(1000, 0), "c1")
    assert store.record_job(job(1010, 1), "c1") == pk      # Slurm's requeue: new submit time
    assert store.record_job(job(1030, 2), "c1") == pk
    row = store.job(pk)
    assert row["submit_time"] == 1000 and row["restart_count"] == 2


def test_reused_job_id_starts_a_new_history(tmp_path):
    store = Store(tmp_path / "r.db")
    old = store.record_job(job(1000, 2), "c1")
    assert store.record_job(job(5000, 0), "c1") != old       # restart count back at 0
    other_user = store.record_job(job(6000, 1, user="bo"), "c1")
    assert other_user not in (old,)


class _Catch(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        _Catch.got.append(json.loads(self.rfile.read(length)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def _rec(values: dict) -> Recommendation:
    """A job's stop, as the actuator hands it to notify."""
    return Recommendation.from_row({"mode": "action", "status": "executing", **values})


def test_notify_posts_the_stop_to_a_url():
    server = HTTPServer(("127.0.0.1", 0), _Catch)
    threading.Thread(target=server.handle_request, daemon=True).start()
    rec = _rec({"id": 7, "job_id": "42", "attempt": 2, "action": "stop", "rule": "no_progress",
                "reason": "no new checkpoint over the last 3 attempts", "user": "ana"})
    sent = notify(f"http://127.0.0.1:{server.server_port}/hook", rec)
    server.server_close()
    assert sent.ok and "204" in sent.detail
    assert _Catch.got[-1]["rule"] == "no_progress" and _Catch.got[-1]["job"] == "42"


def test_notify_failure_is_reported_not_raised():
    rec = _rec({"id": 1, "job_id": "1", "attempt": 0, "action": "stop", "rule": "x",
                "reason": ""})
    sent = notify("http://127.0.0.1:9/nothing", rec)
    assert not sent.ok and "POST" in sent.detail
    assert not notify("carrier-pigeon", rec).ok


def test_second_agent_on_one_store_refuses_to_start(tmp_path):
    from click.testing import CliRunner

    from recovery_agent.agent import main as agent_main
    config = tmp_path / "recovery.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}"\n[api]\nauth = "none"\n')
    first = StoreLock(tmp_path / "recovery.db")
    first.acquire()
    try:
        result = CliRunner().invoke(agent_main, ["--config", str(config), "--no-watch"])
    finally:
        first.release()
    assert result.exit_code == 1
    assert "another recovery-agent" in result.output and str(os.getpid()) in result.output


def test_array_task_stored_by_numeric_id_takes_its_printable_name(tmp_path):
    store = Store(tmp_path / "r.db")
    pk = store.record_job(Job(job_id="16", numeric_id=16, submit_time=0), "c1")
    task = Job(job_id="12_3", numeric_id=16, array_job_id=12, array_task_id=3,
               submit_time=1000)
    store.adopt_printable_id("c1", task)
    row = store.find_job("c1", "12_3")
    assert row["id"] == pk and row["array_job_id"] == 12 and row["array_task_id"] == 3
    assert store.record_job(task, "c1") == pk          # and the poller finds that row
    store.adopt_printable_id("c1", task)                # idempotent
    assert store.find_job("c1", "16") is None


def test_notify_slack_compatible_webhook_gets_text():
    server = HTTPServer(("127.0.0.1", 0), _Catch)
    threading.Thread(target=server.handle_request, daemon=True).start()
    rec = _rec({"id": 9, "job_id": "43", "attempt": 1, "action": "stop", "rule": "app_error",
                "reason": "KeyError in train.py", "user": "ana"})
    sent = notify(f"slack:http://127.0.0.1:{server.server_port}/services/T/B/x", rec)
    server.server_close()
    assert sent.ok and sent.detail.startswith("slack ")
    assert set(_Catch.got[-1]) == {"text"}
    assert "job 43" in _Catch.got[-1]["text"] and "KeyError" in _Catch.got[-1]["text"]


def test_notify_targets_merge_the_job_and_the_environment():
    from recovery_agent.act.notify import targets
    assert targets("mail", "slack:https://h/x, mail,https://ops/y") == \
        ["mail", "slack:https://h/x", "https://ops/y"]
    assert targets("none", "") == [] and targets(None, " ") == []


def test_environment_notify_is_checked():
    from recovery_agent.config import from_mapping
    from recovery_agent.errors import ConfigError
    cfg = from_mapping({"environments": {"prod": {"notify": "mail,slack:https://h/x"}}})
    assert cfg.environment("prod").notify.startswith("mail")
    with pytest.raises(ConfigError, match="environments.prod.notify"):
        from_mapping({"environments": {"prod": {"notify": "pager:123"}}})
